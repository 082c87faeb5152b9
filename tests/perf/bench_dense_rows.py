"""GPU time of one packed linear at the row counts of batched decode (not a test): the Llama-3-8B
layer shapes (q|k|v, o, gate|up as Q4_K, down as Q6_K: a Q4_K_M file's), random blocks, through
each path at each row count: the packed GEMVs (up to 8 rows: `TritonLinear.matmul`), the int8
GEMM over the packed blocks (`grouped.dense_gemm`, with its activation quantization; the path of
9-64 rows; past 64 in blocks of 64 rows, to find where it stops paying) and a bf16 copy of the
weight with a bf16 GEMM (the path past 64 rows); `--reps` calls captured in one CUDA graph and
timed replayed, after a warm-up. Prints one markdown table: us per call, the weight's GB/s, and
the per-layer sum.

    python tests/perf/bench_dense_rows.py [--rows 1,4,5,8,9,16,32,64,128,256,512] [--reps 50]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from make_synthetic import random_rows

from localllm.kernels.moe.grouped import dense_gemm, prepare_dense
from localllm.kernels.quant import QuantType, prepare_linear, triton_linear
from localllm.kernels.quant.triton_packed import dequantize_packed_t, quantize_x8

SHAPES = {  # name: (N, K, type) of one Llama-3-8B layer
    "qkv": (6144, 4096, "Q4_K"),
    "o": (4096, 4096, "Q4_K"),
    "gate_up": (28672, 4096, "Q4_K"),
    "down": (4096, 14336, "Q6_K"),
}


def _time(fn, reps: int) -> float:
    """GPU microseconds of one call: `reps` calls captured in one CUDA graph, replayed (eager
    calls measure the host's launches: 2026-12-07 08:18, tests/perf/results/server.md)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,5,8,9,16,32,64,128,256,512")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    rng = np.random.default_rng(0)
    lins = {}
    for name, (n, k, t) in SHAPES.items():
        raw = torch.from_numpy(random_rows(QT[t], n, k, rng)).cuda()
        lins[name] = (prepare_linear(raw, QuantType[t], (n, k), strategy="triton"), k, raw.numel())
    prepare_dense(torch.device("cuda", torch.cuda.current_device()), max(rows))
    paths = {
        "GEMV": lambda lin, x: lin.matmul(x),
        "int8 GEMM": lambda lin, x: dense_gemm(quantize_x8(x), lin.packed, x.shape[0]),
        "bf16 copy": lambda lin, x: torch.mm(x.bfloat16(), dequantize_packed_t(lin.packed)),
    }
    print(f"{torch.cuda.get_device_name()}; us per call (weight GB/s)")
    print("| rows | path | " + " | ".join(SHAPES) + " | layer us |")
    print("|---:|---|" + "---:|" * (len(SHAPES) + 1))
    for m in rows:
        for path, fn in paths.items():
            if path == "GEMV" and m > triton_linear.GEMV_MAX_M:
                continue
            cells, total = [], 0.0
            for lin, k, nbytes in lins.values():
                x = torch.randn(m, k, device="cuda")
                us = _time(lambda lin=lin, x=x, fn=fn: fn(lin, x), a.reps)
                total += us
                cells.append(f"{us:.1f} ({nbytes / us / 1e3:.0f})")
            print(f"| {m} | {path} | " + " | ".join(cells) + f" | {total:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
