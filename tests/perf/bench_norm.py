"""RMSNorm (+ residual, + quantized twin) launch geometry on the H200 (run there; not a test).

    python tests/perf/bench_norm.py

GPU time per call of `add_rms_norm_cuda` for one decode row of the Llama-3-8B (4096) and
Qwen3-30B-A3B (2048) widths, with and without the quantized output, per warp count, from
CUDA-graph replays.
"""

from functools import partial

import torch

from localllm.kernels.fused.triton_ops import add_rms_norm_cuda
from tests.perf.bench_attention import _time


def main() -> None:
    print("| width | quantized twin | warps | us per call |")
    print("|---:|---|---:|---:|")
    for d in (2048, 4096):
        x, r = torch.randn(1, d, device="cuda"), torch.randn(1, d, device="cuda")
        w = torch.rand(d, device="cuda")
        for quant in (False, True):
            for warps in (1, 2, 4, 8, 16):
                us = _time(partial(add_rms_norm_cuda, x, r, w, 1e-6, quant, warps))
                print(f"| {d} | {quant} | {warps} | {us:.2f} |")


if __name__ == "__main__":
    main()
