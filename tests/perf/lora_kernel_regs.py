"""Compile the LoRA triton kernels (`kernels/fused/triton_lora*.py`) for sm_90 on a machine
without a GPU and print ptxas's registers and spills per configuration (issue 36): the check that
found the float32 "ieee" tl.dot tiles spilling kilobytes. Not a test; needs triton with its
bundled ptxas (on the CPU box: PYTHONPATH=/work/tri-site).

    python tests/perf/lora_kernel_regs.py

Then the packed dp4a GEMVs with the LoRA epilogue (`kernels/quant/triton_lora_tail.py`, the
"epilogue" scheme; LS: the shrink inline too, "inline") at the 8B decode geometry (1 warp, 64
columns, split K), LR = 0 (none: the base kernel), 16 (one rank-16 adapter) and 64 (four), one
and four rows; and one adapter whose t is 1 or 56 partials (a norm's, a SiLU product's), the
latter also summed by split 0's programs (`EARLY_TAIL`).
"""

import inspect
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localllm.kernels.fused import triton_lora, triton_lora_fused
from localllm.kernels.quant import triton_dp4a
from localllm.kernels.quant.triton_lora_tail import partial_chunk

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


# the packed GEMVs' argument types (the rest: "_ptr" float32, else i32)
GEMV = {"x8_ptr": "*i32", "qs_ptr": "*i32", "hdr_ptr": "*i32", "cnt_ptr": "*i32",
        "ids_ptr": "*i64", "lb_ptr": "*fp16", "lc_ptr": "*i32", "s16_ptr": "*i32",
        "ql_ptr": "*i32", "qh_ptr": "*i32", "sc_ptr": "*i32", "d_ptr": "*fp16",
        "la_ptr": "*fp16"}  # fmt: skip
GEMV_CONFIGS = [  # (kernel, constexprs)
    (triton_dp4a._gemv_q4k_packed, {"spb": 1, "SPLIT": 16}),
    (triton_dp4a._gemv_q6k_packed, {"spb": 2, "SPLIT": 28}),
    (triton_dp4a._gemv_q8_0_packed, {"spb": 4, "SPLIT": 32, "Q5": False}),  # (GPU tests' model)
]


def usage(kernel, extra: dict, consts: dict, warps: int = 4) -> str:
    consts = {**consts, "PDL": True}
    if "ZR" in inspect.signature(kernel.fn).parameters:
        consts["ZR"] = triton_lora.ZR
    names = inspect.signature(kernel.fn).parameters
    sig = {n: "constexpr" if n in consts else _type(n, extra) for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
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
    for kernel, geo in GEMV_CONFIGS:
        for lr, ls, np, le in ((0, False, 0, False), (16, False, 0, False),
                               (64, False, 0, False), (16, True, 0, False), (64, True, 0, False),
                               (16, False, 1, False), (16, False, 56, False),
                               (16, False, 56, True), (64, False, 56, True)):  # fmt: skip
            for mp in (1, 4):
                npc = partial_chunk(np, mp)
                consts = {**geo, "MP": mp, "BN": 64, "ASM": True, "MOE": False, "PF": True,
                          "LATE": True, "LR": lr, "LS": ls, "NPC": npc,
                          "LPS": 64 if np else 0, "LE": le, "STAGES": 1}  # fmt: skip
                shown = f"LR={lr}, LS={ls}, MP={mp}, partials {np} ({npc} a load), early {le}"
                print(f"triton_dp4a.{kernel.fn.__name__} {shown}: {usage(kernel, GEMV, consts, 1)}")


if __name__ == "__main__":
    main()
