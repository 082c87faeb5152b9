"""MoE decode's grouped GEMVs: geometry sweep on the Qwen3-30B-A3B expert shapes (run on the
H200; not a test).

    python tests/perf/bench_grouped.py [--copies 4] [--launches 16] [--tokens 1]

A layer's 128 experts are made of random blocks and packed as the engine packs them, `--copies`
times (distinct memory, so the launches' expert bytes outrun the 50 MB L2). A CUDA graph of
`--launches` grouped launches, each over one copy with its own 8 distinct random experts per
token, is timed per launch. Every geometry's output is checked first against the default's on
the same quantized activations (split-K only reorders float sums: 1e-5 relative).
"""

import argparse
from functools import partial

import torch

from tests.perf.bench_gpu import COPY_BW, _blocks

SHAPES = (("gate_up", "Q4_K", 1536, 2048), ("down", "Q4_K", 2048, 768), ("down", "Q6_K", 2048, 768))
GEOS = ((16, 1), (32, 1), (64, 1), (64, 2), (128, 2), (128, 4))
N_EXPERT, K_USED = 128, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--launches", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| weight | type | N x K | tokens | block_n | warps | split | us per launch | GB/s | % |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        sweep(*shape, a, gen)
        torch.cuda.empty_cache()


def sweep(label: str, name: str, n: int, k: int, a, gen: torch.Generator) -> None:
    from triton.testing import do_bench_cudagraph

    from localllm.kernels.quant import QuantType
    from localllm.kernels.quant.repack import pack_expert_blocks
    from localllm.kernels.quant.triton_packed import (
        PackedConfig,
        gemv_packed_grouped,
        packed_config,
        quantize_x8,
    )
    from localllm.kernels.quant.types import block_geometry

    qt = QuantType[name]
    raw = _blocks(qt, N_EXPERT * n, k).view(N_EXPERT, n, -1).cuda()
    packs = [pack_expert_blocks(raw, qt, n, k) for _ in range(a.copies)]
    del raw
    expert_bytes = packs[0].nbytes // N_EXPERT
    xq = quantize_x8(torch.randn(a.tokens, k, device="cuda", generator=gen))
    ids = [
        torch.stack([torch.randperm(N_EXPERT, device="cuda", generator=gen)[:K_USED]
                     for _ in range(a.tokens)]).reshape(-1)
        for _ in range(a.launches)
    ]  # fmt: skip
    nb = k // block_geometry(qt)[0]
    dflt = packed_config(qt, n, k)
    cfgs = {dflt}
    for bn, warps in GEOS:
        for split in sorted({1, 2, 4, nb}):
            if split <= nb:
                cfgs.add(PackedConfig(bn, warps, -(-nb // split)))
    pairs = a.tokens * K_USED

    def run(cfg, counters, i=0):
        return gemv_packed_grouped(xq, packs[i % a.copies], ids[i], K_USED, counters, cfg)

    def chain(cfg, counters):
        for i in range(a.launches):
            run(cfg, counters, i)

    def counters_for(cfg):
        return torch.zeros(pairs * -(-n // cfg.block_n), dtype=torch.int32, device="cuda")

    want = run(dflt, counters_for(dflt))
    best = None
    for cfg in sorted(cfgs, key=lambda c: (c.block_n, c.num_warps, -c.blocks_per_program)):
        cnt = counters_for(cfg)
        got = run(cfg, cnt)
        split = -(-nb // cfg.blocks_per_program)
        err = ((got - want).norm() / want.norm()).item()
        geo = f"{cfg.block_n} | {cfg.num_warps} | {split}"
        head = f"| {label} | {name} | {n}x{k} | {a.tokens} | {geo} |"
        if not err < 1e-5:
            print(f"{head} WRONG rel {err:.3g} | | |")
            continue
        us = do_bench_cudagraph(partial(chain, cfg, cnt), rep=50) * 1e3 / a.launches
        gbs = pairs * expert_bytes / (us * 1e-6) / 1e9
        mark = " (default)" if cfg == dflt else ""
        print(f"{head} {us:.2f}{mark} | {gbs:.0f} | {100 * gbs * 1e9 / COPY_BW:.0f} |")
        if best is None or us < best[0]:
            best = (us, cfg)
    print(f"best {label} {name} tokens {a.tokens}: {best}")


if __name__ == "__main__":
    main()
