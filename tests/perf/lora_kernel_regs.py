"""Compile the LoRA triton kernels (`kernels/fused/triton_lora*.py`) for sm_90 on a machine
without a GPU and print ptxas's registers and spills per configuration (issue 36): the check that
found the float32 "ieee" tl.dot tiles spilling kilobytes. Not a test; needs triton with its
bundled ptxas (on the CPU box: PYTHONPATH=/work/tri-site).

    python tests/perf/lora_kernel_regs.py
"""

import inspect
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localllm.kernels.fused import triton_lora, triton_lora_fused

W16 = {"a_ptr": "*fp16", **{f"b{i}": "*fp16" for i in range(3)}}
CONFIGS = [  # (kernel, extra arg types, constexprs)
    (triton_lora._shrink, {}, {"BT": 1, "BR": 64, "BK": 128, "DOT": False}),
    (triton_lora._shrink, {}, {"BT": 16, "BR": 64, "BK": 128, "DOT": True}),
    (triton_lora._expand, {"cnt_ptr": "*i32"}, {"BT": 1, "BR": 64, "BN": 64, "DOT": False}),
    (triton_lora._expand, {"cnt_ptr": "*i32"}, {"BT": 16, "BR": 64, "BN": 64, "DOT": True}),
    (triton_lora._expand, {"cnt_ptr": "*i32"}, {"BT": 1, "BR": 256, "BN": 32, "DOT": False}),
    (triton_lora_fused._fused, {"sync_ptr": "*i32"},
     {"BT": 1, "BR": 64, "BK": 128, "RANK": 64, "BN": 64, "DOT": False}),
    (triton_lora_fused._fused, {"sync_ptr": "*i32"},
     {"BT": 16, "BR": 64, "BK": 128, "RANK": 64, "BN": 64, "DOT": True}),
]  # fmt: skip


def _type(name: str, extra: dict) -> str:
    if name in extra or name in W16:
        return {**W16, **extra}[name]
    pointer = name.endswith("_ptr") or (name[0] in "yb" and name[1:].isdigit())
    return "*fp32" if pointer else "i32"


def usage(kernel, extra: dict, consts: dict) -> str:
    consts = {**consts, "PDL": True}
    if "ZR" in inspect.signature(kernel.fn).parameters:
        consts["ZR"] = triton_lora.ZR
    names = inspect.signature(kernel.fn).parameters
    sig = {n: "constexpr" if n in consts else _type(n, extra) for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True)  # fmt: skip
    info = [ln.split("info    : ")[-1] for ln in (out.stderr + out.stdout).splitlines()
            if "registers" in ln or "spill" in ln]  # fmt: skip
    return " | ".join(info) or out.stderr.strip()[-200:]


def main() -> None:
    for kernel, extra, consts in CONFIGS:
        mod = kernel.fn.__module__.rsplit(".", 1)[-1]
        shown = ", ".join(f"{k}={v}" for k, v in consts.items())
        print(f"{mod}.{kernel.fn.__name__} {shown}: {usage(kernel, extra, consts)}")


if __name__ == "__main__":
    main()
