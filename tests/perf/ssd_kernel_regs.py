"""Compile the chunked Mamba-2 scan's triton kernels (`kernels/recurrent/triton_ssd_chunked.py`)
for sm_90 on a machine without a GPU and print, per dot precision and launch: ptxas's registers
and spills, and the PTX's float32 FMAs and tensor-core (mma) instructions (issue 40: why "ieee"
ran 9x slower than "tf32x3" on an H100). Not a test; needs triton with its bundled ptxas (on the
CPU box: PYTHONPATH=/work/tri-site).

    python tests/perf/ssd_kernel_regs.py
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localllm.kernels.recurrent import triton_ssd_chunked as ch

# (precision, chunk L, head-dim columns BP, warps): the H100 run's scan-alone configurations
CONFIGS = [("ieee", 64, 32, 4), ("tf32", 64, 32, 4), ("tf32x3", 64, 32, 4), ("ieee", 64, 32, 8),
           ("ieee", 64, 64, 8), ("ieee", 32, 32, 4), ("ieee", 32, 16, 4), ("ieee", 128, 32, 8),
           ("tf32x3", 64, 32, 8), ("tf32x3", 128, 32, 8)]  # fmt: skip
BN = 128  # Granite-4.0-H's state size


def usage(kernel, consts: dict, warps: int) -> str:
    names = kernel.arg_names
    ints = ("chunks_ptr", "seq_chunks_ptr")
    sig = {
        n: "constexpr" if n in consts else "*i32" if n in ints else "*fp32" if n.endswith("_ptr")
        else "i32"
        for n in names
    }  # fmt: skip
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx_text = k.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(ptx_text)
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True)  # fmt: skip
    info = [ln.split("info    : ")[-1].strip() for ln in (out.stderr + out.stdout).splitlines()
            if "registers" in ln or "spill" in ln]  # fmt: skip
    fma = ptx_text.count("fma.rn.f32")
    mma = len(re.findall(r"\b(?:mma|wgmma)\.", ptx_text))
    return f"{' | '.join(info) or out.stderr.strip()[-200:]} | fma.f32 {fma}, mma {mma}"


def main() -> None:
    for prec, chunk, bp, warps in CONFIGS:
        consts = {"L": chunk, "BP": bp, "BN": BN, "PREC": prec}
        for kernel in (ch._chunk_state, ch._chunk_out):
            head = f"{prec} L {chunk} BP {bp} {warps} warps {kernel.fn.__name__}"
            print(f"{head}: {usage(kernel, consts, warps)}", flush=True)


if __name__ == "__main__":
    main()
