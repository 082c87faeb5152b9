"""MoE decode's grouped GEMVs: geometry sweep on a MoE model's expert shapes (run on the H200;
not a test).

    python tests/perf/bench_grouped.py [--copies 4] [--launches 16] [--tokens 1]
        [--model qwen3moe|glm|qwen3next|lfm2moe] [--stages 1,2,3]

`--model`: Qwen3-30B-A3B (the default: 128 experts, 8 a token), GLM-4.5-Air (128, 8; 4,096 wide,
1,408 an expert), Qwen3-Next-80B-A3B (512, 10; 2,048 and 512) or LFM2-8B-A1B (32, 4; 2,048 and
1,792). `--stages`: each geometry also with its loop over blocks in that many cp.async stages
(`triton_packed.GEMV_STAGES`; a program of one block has no loop to stage).

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

GEOS = ((16, 1), (32, 1), (64, 1), (64, 2), (128, 2), (128, 4))
# model -> (experts, used a token, hidden, an expert's FFN width)
MODELS = {"qwen3moe": (128, 8, 2048, 768), "glm": (128, 8, 4096, 1408),
          "qwen3next": (512, 10, 2048, 512), "lfm2moe": (32, 4, 2048, 1792)}  # fmt: skip
N_EXPERT, K_USED = 128, 8


def shapes(model: str) -> tuple:
    """(label, type, N, K) of the expert weights: gate|up, and down in Q4_K and Q6_K (Q4_K_M's
    "more bits" layers)."""
    _, _, d, f = MODELS[model]
    return (("gate_up", "Q4_K", 2 * f, d), ("down", "Q4_K", d, f), ("down", "Q6_K", d, f))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--launches", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--model", choices=list(MODELS), default="qwen3moe")
    ap.add_argument("--stages", default="1")
    a = ap.parse_args()
    global N_EXPERT, K_USED
    N_EXPERT, K_USED = MODELS[a.model][:2]
    a.stages = [int(s) for s in a.stages.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{a.model}: {N_EXPERT} experts, {K_USED} a token")
    print("| weight | type | N x K | tokens | block_n | warps | split | stages | us per launch "
          "| GB/s | % |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in shapes(a.model):
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
                spb = -(-nb // split)
                cfgs |= {PackedConfig(bn, warps, spb, st) for st in a.stages if st == 1 or spb > 1}
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
    for cfg in sorted(cfgs, key=lambda c: (c.block_n, c.num_warps, -c.blocks_per_program,
                                           c.stages)):  # fmt: skip
        cnt = counters_for(cfg)
        got = run(cfg, cnt)
        split = -(-nb // cfg.blocks_per_program)
        err = ((got - want).norm() / want.norm()).item()
        geo = f"{cfg.block_n} | {cfg.num_warps} | {split} | {cfg.stages}"
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
