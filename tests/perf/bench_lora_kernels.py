"""GPU time of one decode step's LoRA deltas alone, per kernel scheme (issue 36). Not a test.

One step of a Llama-3-8B-shaped model has 32 layers x 4 adapted modules (q|k|v, o, gate|up,
down); this captures those 128 calls of one scheme (`engine.lora.delta.SCHEME`: the default
"atomic" two-launch kernels, "fused" one launch, or "torch" ops) in
one CUDA graph, replays it and prints microseconds per step and per module, for 1 and 4 rank-16
adapters and 1 and 4 rows. No GEMVs between the calls: the figure is the deltas' own cost.

    python tests/perf/bench_lora_kernels.py [--reps 50] [--layers 32] [--schemes atomic,fused]
"""

import argparse

import torch

from localllm.kernels.fused import triton_lora, triton_lora_fused
from localllm.kernels.fused.lora_delta import LoraPart, scratch, shrink_expand_reference

# (in, part outputs) of the 8B shape's four adapted modules
MODULES = [(4096, [4096, 1024, 1024]), (4096, [4096]), (4096, [14336, 14336]), (14336, [4096])]
SCHEMES = ("atomic", "fused", "torch")
DEVICE = "cuda"  # (cpu under TRITON_INTERPRET=1: `check` only, to try the script without a GPU)


def _module(k: int, outs: list[int], adapters: int, rank: int, rows: int):
    g = torch.Generator(device=DEVICE).manual_seed(k + len(outs))
    r_part = adapters * rank
    a = (0.02 * torch.randn(r_part * len(outs), k, device=DEVICE, generator=g)).half()
    parts = [LoraPart(i * r_part, (i + 1) * r_part,
                      (0.02 * torch.randn(r_part, n, device=DEVICE, generator=g)).half())
             for i, n in enumerate(outs)]  # fmt: skip
    w = torch.ones(2048, a.shape[0], device=DEVICE)
    x = torch.randn(rows, k, device=DEVICE)
    y = torch.zeros(rows, sum(outs), device=DEVICE)
    ys = list(y.split(outs, dim=1))
    return x, a, w, parts, ys, scratch(a.shape[0], DEVICE)


def _call(scheme: str, m) -> None:
    x, a, w, parts, ys, pad = m
    if scheme == "atomic":
        triton_lora.shrink_expand(x, a, w, parts, ys, pad)
    elif scheme == "fused":
        triton_lora_fused.shrink_expand(x, a, w, parts, ys, pad)
    else:  # the engine's torch ops (`LoraDelta._low` and `_addmm` on float16 weights)
        t = torch.mm(x.to(a.dtype), a.T).mul_(w[: x.shape[0]])
        for p, y in zip(parts, ys, strict=True):
            y += (t[:, p.lo : p.hi] @ p.b_t).to(y.dtype)


def step_us(scheme: str, mods: list, reps: int) -> float:
    for m in mods:  # compile and warm outside the capture
        _call(scheme, m)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m in mods:
            _call(scheme, m)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def check(mods: list, schemes: list[str]) -> float:
    """The largest |difference| of the kernel schemes from the reference on the first module."""
    x, a, w, parts, ys, _ = mods[0]
    want = [y.clone() for y in ys]
    shrink_expand_reference(x, a, w, parts, want)
    worst = 0.0
    for scheme in schemes:
        got = [y.clone() for y in ys]
        _call(scheme, (x, a, w, parts, got, mods[0][5]))
        worst = max(worst, max((g - v).abs().max().item() for g, v in zip(got, want, strict=True)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated: {SCHEMES}")
    a = ap.parse_args()
    schemes = [s for s in a.schemes.split(",") if s in SCHEMES]
    calls = a.layers * len(MODULES)
    print(f"| adapters | rows | {' | '.join(f'{s} us/step (/module)' for s in schemes)} |")
    print("|---:|---:|" + "---:|" * len(schemes))
    for adapters in (1, 4):
        for rows in (1, 4):
            mods = [_module(k, outs, adapters, a.rank, rows)
                    for _ in range(a.layers) for k, outs in MODULES]  # fmt: skip
            diff = check(mods, [s for s in schemes if s != "torch"])
            cells = []
            for scheme in schemes:
                us = step_us(scheme, mods, a.reps)
                cells.append(f"{us:.0f} ({us / calls:.2f})")
            print(f"| {adapters} | {rows} | {' | '.join(cells)} |  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
