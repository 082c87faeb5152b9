"""GPU time of one packed linear at the row counts of batched decode (not a test): the Llama-3-8B
layer shapes (q|k|v, o, gate|up as Q4_K, down as Q6_K: a Q4_K_M file's), random blocks, through
each path at each row count: the packed GEMVs (up to 8 rows: `TritonLinear.matmul`), the int8
GEMM over the packed blocks (`grouped.dense_gemm`, with its activation quantization; past 64 in
blocks of 64 rows, to find where it stops paying), the batch GEMM that expands the weight's tiles
in registers (`batch_gemm`, 9-64 rows, its default geometry) and a bf16 copy of the weight with
a bf16 GEMM (the path past 64 rows, and of 9-64 while `BATCH_GEMM` is off); `--reps` calls
captured in one CUDA graph and timed replayed, after a warm-up. Prints one markdown table: us
per call, the weight's GB/s, and the per-layer sum. `--sweep` then times `batch_gemm` over tile
widths, warps and split-K targets at 16 and 64 rows (one table, per-layer sums), to choose
`BatchGemmConfig`'s defaults.

    python tests/perf/bench_dense_rows.py [--rows 1,4,5,8,9,16,32,64,128,256,512] [--reps 50]
    python tests/perf/bench_dense_rows.py --rows 16,64 --sweep
"""

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from make_synthetic import random_rows

from localllm.kernels.moe.grouped import dense_gemm, prepare_dense
from localllm.kernels.quant import QuantType, prepare_linear, triton_linear
from localllm.kernels.quant.batch_gemm import MAX_ROWS, BatchGemmConfig, batch_gemm
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
    p.add_argument("--sweep", action="store_true", help="also sweep batch_gemm's geometry")
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
        "batch GEMM": lambda lin, x: batch_gemm(x, lin.packed),
        "bf16 copy": lambda lin, x: torch.mm(x.bfloat16(), dequantize_packed_t(lin.packed)),
    }
    print(f"{torch.cuda.get_device_name()}; us per call (weight GB/s)")
    print("| rows | path | " + " | ".join(SHAPES) + " | layer us |")
    print("|---:|---|" + "---:|" * (len(SHAPES) + 1))
    for m in rows:
        for path, fn in paths.items():
            if path == "GEMV" and m > triton_linear.GEMV_MAX_M:
                continue
            if path == "batch GEMM" and m > MAX_ROWS:
                continue
            print(f"| {m} | {path} | " + _row(lins, m, fn, a.reps))
    if a.sweep:
        _sweep(lins, [m for m in rows if m in (16, 64)], a.reps)
    return 0


def _row(lins: dict, m: int, fn, reps: int) -> str:
    """One table row's cells: us (GB/s) per shape, then the layer's sum."""
    cells, total = [], 0.0
    for lin, k, nbytes in lins.values():
        x = torch.randn(m, k, device="cuda")
        us = _time(lambda lin=lin, x=x: fn(lin, x), reps)
        total += us
        cells.append(f"{us:.1f} ({nbytes / us / 1e3:.0f})")
    return " | ".join(cells) + f" | {total:.1f} |"


def _sweep(lins: dict, rows: list[int], reps: int) -> None:
    print("\nbatch_gemm geometry; us per call (weight GB/s)")
    print("| rows | BN | warps | stages | target | " + " | ".join(SHAPES) + " | layer us |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * (len(SHAPES) + 1))
    for m in rows:
        for bn, warps, stages, target in itertools.product(
            (32, 64, 128), (4, 8), (3,), (132, 264, 528, 1056)
        ):
            cfg = BatchGemmConfig(block_n=bn, warps=warps, stages=stages, target_programs=target)
            fn = lambda lin, x, cfg=cfg: batch_gemm(x, lin.packed, cfg)
            print(f"| {m} | {bn} | {warps} | {stages} | {target} | " + _row(lins, m, fn, reps))


if __name__ == "__main__":
    sys.exit(main())
