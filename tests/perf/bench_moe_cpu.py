"""Benchmark of routed-expert compute on the CPU: one decode token's experts of one MoE layer of
Qwen3-30B-A3B's shape, dequantized per use (the old path) vs prepared once. Not a test.

A synthetic layer: dim 2048, expert hidden 768, 128 experts, top-8; gate/up Q4_K, down Q6_K
(Qwen3-30B-A3B Q4_K_M's mix). gguf-py cannot quantize Q4_K/Q6_K, so the blocks are random codes
with realistic fp16 scales (weights of ~0.02; the kernels' speed does not depend on values).
Each timed step routes one token (T=1) to 8 experts drawn at random from the 128, so the weights
come from memory as in a real decode, not from the cache. Also: the preparation time and the
bytes per expert (raw blocks, prepared form).

    python tests/perf/bench_moe_cpu.py [--threads 2] [--steps 20] [--experts 128] [--rows 2 4 ...]
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.kernels.test_moe_prepared

from localllm.kernels.cpu.native import load as load_native
from localllm.kernels.moe import ExpertBlocks, ExpertFormat, expert_ffn_grouped
from localllm.kernels.moe.prepared import prepare_expert, prepared_format_nbytes
from localllm.kernels.quant import QuantType
from tests.kernels.test_moe_prepared import expert_blocks

DIM, HIDDEN, TOP_K = 2048, 768, 8


def time_steps(run, n_expert: int, steps: int, seed: int) -> list[float]:
    """Seconds of each decode step's routed-expert compute `run(x, weights, ids)` (one warm-up
    step first)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps + 1):
        x = torch.randn(1, DIM, generator=gen)
        ids = torch.randperm(n_expert, generator=gen)[:TOP_K][None]
        w = torch.softmax(torch.randn(1, TOP_K, generator=gen), -1)
        t0 = time.perf_counter()
        run(x, w, ids)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="*", default=[2, 4, 8, 16, 64, 256])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    g = torch.from_numpy(expert_blocks(QT.Q4_K, a.experts, HIDDEN, DIM, rng))
    u = torch.from_numpy(expert_blocks(QT.Q4_K, a.experts, HIDDEN, DIM, rng))
    d = torch.from_numpy(expert_blocks(QT.Q6_K, a.experts, DIM, HIDDEN, rng))
    fmt = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, DIM, HIDDEN)

    def raw(e: int) -> ExpertBlocks:
        return ExpertBlocks(g[e], u[e], d[e])

    t0 = time.perf_counter()
    prepared = [prepare_expert(raw(e), fmt) for e in range(a.experts)]
    prep_s = (time.perf_counter() - t0) / a.experts
    raw_b = g[0].numel() + u[0].numel() + d[0].numel()
    assert prepared[0].nbytes == prepared_format_nbytes(fmt)

    def grouped(fetch):
        return lambda x, w, ids: expert_ffn_grouped(x, w, ids, fetch, fmt)

    old = time_steps(grouped(raw), a.experts, min(a.steps, 5), seed=1)  # seconds each: few steps
    new = time_steps(grouped(prepared.__getitem__), a.experts, a.steps, seed=1)
    x = torch.randn(1, DIM)
    ids = torch.arange(TOP_K)[None]
    w = torch.full((1, TOP_K), 1 / TOP_K)
    ref = expert_ffn_grouped(x, w, ids, raw, fmt)
    err = (expert_ffn_grouped(x, w, ids, prepared.__getitem__, fmt) - ref).norm() / ref.norm()

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    print(f"# {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, threads {a.threads}")
    print(f"one layer, T=1, top-{TOP_K} of {a.experts}, dim {DIM}, hidden {HIDDEN}, Q4_K/Q6_K")
    kinds = f"{prepared[0].gate.kind}/{prepared[0].up.kind}/{prepared[0].down.kind}"
    for name, s in (("dequant per use", old), (f"prepared ({kinds})", new)):
        ms = 1e3 * float(np.median(s))
        print(f"  {name:36s} median {ms:8.2f} ms/token-layer  (min {1e3 * min(s):.2f}, n={len(s)})")
    speed = float(np.median(old) / np.median(new))
    print(f"  speed-up {speed:.1f}x; prepared vs exact rel. error {err:.1e}")
    layers = 48  # Qwen3-30B-A3B: what the routed experts alone cost per decoded token
    print(f"  x {layers} layers: {layers * np.median(new):.3f} s/token prepared, ", end="")
    print(f"{layers * np.median(old):.2f} s/token dequant per use (routed experts only)")
    print(f"  prepare: {1e3 * prep_s:.1f} ms/expert; bytes/expert raw {raw_b:,}", end="")
    print(f", prepared {prepared[0].nbytes:,} ({prepared[0].nbytes / raw_b:.2f}x raw)")
    native = load_native()
    if native is None:
        print("  native kernels: none (no C compiler, or their self-check failed)")
        return
    types = (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    run = lambda x, w, ids: native.moe_ffn(x, w, ids, g, u, d, types)
    nat = time_steps(run, a.experts, a.steps, seed=1)
    got = native.moe_ffn(x, w, ids, g, u, d, types)
    nerr = (got - ref).norm() / ref.norm()
    ms = 1e3 * float(np.median(nat))
    name, gain = "native (raw blocks, int8 activations)", np.median(new) / np.median(nat)
    print(f"  {name:36s} median {ms:8.2f} ms/token-layer  (min {1e3 * min(nat):.2f}", end="")
    print(f", n={len(nat)}); {gain:.1f}x prepared; rel. error {nerr:.1e}", end="")
    print(f"; flags {' '.join(native.flags)}")
    # more rows per call (decode batches, prompt chunks): where the native kernels stop paying
    gen, fetch = torch.Generator().manual_seed(2), prepared.__getitem__
    for rows in a.rows:
        x = torch.randn(rows, DIM, generator=gen)
        ids = torch.stack([torch.randperm(a.experts, generator=gen)[:TOP_K] for _ in range(rows)])
        w = torch.softmax(torch.randn(rows, TOP_K, generator=gen), -1)
        times = {}
        for name, f in (
            ("prepared", lambda x=x, w=w, i=ids: expert_ffn_grouped(x, w, i, fetch, fmt)),
            ("native", lambda x=x, w=w, i=ids: native.moe_ffn(x, w, i, g, u, d, types)),
        ):
            f()
            reps = max(2, 20 // rows)
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            times[name] = (time.perf_counter() - t0) / reps
        print(f"  {rows:4d} rows: prepared {1e3 * times['prepared']:8.2f} ms, native ", end="")
        print(f"{1e3 * times['native']:8.2f} ms per layer call")


if __name__ == "__main__":
    main()
