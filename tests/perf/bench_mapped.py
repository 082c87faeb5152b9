"""Routed experts read by the GPU straight from host memory ("mapped"), against the same experts
resident on the GPU: Qwen3-30B-A3B-shaped layers (dim 2048, hidden 768, 128 experts, top-8, gate/up
Q4_K, down Q6_K) packed once, their planes copied to page-locked host memory, and the same grouped
GEMV kernels run over either copy inside a CUDA graph. Also the bus's copy bandwidth and the host's
memory read bandwidth. Not a test; needs CUDA.

    python tests/perf/bench_mapped.py [--layers 4] [--reps 40] [--rows 1 8]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from localllm.kernels.moe import ExpertFormat
from localllm.kernels.moe.packed import expert_ffn_packed, pack_experts
from localllm.kernels.quant import QuantType
from localllm.offload.mapped import map_packed_experts
from tests.kernels.test_moe_prepared import expert_blocks

DIM, HIDDEN, TOP_K, E = 2048, 768, 8, 128


def _layer(rng) -> tuple[torch.Tensor, ...]:
    g = expert_blocks(QT.Q4_K, E, HIDDEN, DIM, rng)
    u = expert_blocks(QT.Q4_K, E, HIDDEN, DIM, rng)
    d = expert_blocks(QT.Q6_K, E, DIM, HIDDEN, rng)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (g, u, d))


def time_graph(layers, fmt: ExpertFormat, rows: int, reps: int) -> float:
    """Seconds per layer of T=`rows` routed experts, captured in one graph over every layer;
    fresh random experts on every replay (copied in before the timed replay)."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, DIM, device=dev)
    w = torch.softmax(torch.randn(rows, TOP_K, device=dev), -1)
    ids = [torch.zeros(rows, TOP_K, dtype=torch.int64, device=dev) for _ in layers]

    def fill() -> None:
        for t in ids:
            t.copy_(torch.stack([torch.randperm(E, generator=gen, device=dev)[:TOP_K]
                                 for _ in range(rows)]))  # fmt: skip

    fill()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for pe, i in zip(layers, ids, strict=True):  # warm-up: compile outside the capture
            expert_ffn_packed(x, w, i, pe, fmt)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for pe, i in zip(layers, ids, strict=True):
            expert_ffn_packed(x, w, i, pe, fmt)
    times = []
    for _ in range(reps):
        fill()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(layers))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    fmt = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, DIM, HIDDEN)
    raw = [_layer(rng) for _ in range(a.layers)]
    dev = [pack_experts(*(t.cuda() for t in r), fmt, TOP_K) for r in raw]
    t0 = time.perf_counter()
    host = [map_packed_experts(pe) for pe in dev]
    map_s = time.perf_counter() - t0
    per_expert = dev[0].nbytes / E
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"layer: {E} experts, {dev[0].nbytes / 2**20:.0f} MiB packed, {per_expert / 1e6:.2f} MB"
          f" per expert; mapped {a.layers} layers in {map_s:.2f} s")  # fmt: skip
    x = torch.randn(8, DIM, device="cuda")
    w = torch.softmax(torch.randn(8, TOP_K, device="cuda"), -1)
    ids = torch.randint(0, E, (8, TOP_K), device="cuda")
    same = torch.equal(expert_ffn_packed(x, w, ids, dev[0], fmt),
                       expert_ffn_packed(x, w, ids, host[0], fmt))  # fmt: skip
    print(f"mapped output bit-equal to resident: {same}")
    for rows in a.rows:
        for name, layers in (("resident", dev), ("mapped", host)):
            s = time_graph(layers, fmt, rows, a.reps)
            # bytes of the distinct experts a step reads (T rows x 8 random of 128, expected)
            distinct = E * (1 - (1 - TOP_K / E) ** rows)
            gbs = distinct * per_expert / s / 1e9
            print(f"T={rows} {name:8s}: {s * 1e6:8.1f} us/layer, {gbs:6.1f} GB/s "
                  f"({distinct:.1f} experts)")  # fmt: skip
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print(f"pinned host -> GPU copy: {5 * n / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
    big = torch.ones(n // 2, dtype=torch.float32)
    big.sum()
    for threads in sorted({1, 4, 8, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for _ in range(3):
            big.sum()
        print(f"host read (torch sum, {threads} threads): "
              f"{3 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
