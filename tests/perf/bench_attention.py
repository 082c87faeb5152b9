"""Flash-decoding launch geometry on the H200 (run there; not a test).

    python tests/perf/bench_attention.py

For the Llama-3-8B (32 q / 8 kv heads) and Qwen3-30B-A3B (32 / 4) attention shapes, one
single-token query over m padded keys (the decode graph's table buckets): the GPU time of
`flash_decode` (split + combine) per call from CUDA-graph replays, for the FMA or tensor-core
split (`dot` exact or native) x keys per step x warps, each checked against the plain-torch
reference first.
"""

import itertools
from functools import partial

import torch

from localllm.kernels.attention.decode import decode_attention
from localllm.kernels.attention.decode_plan import DecodePlan
from localllm.kernels.attention.triton_decode import flash_decode

SHAPES = {"llama3-8b": (32, 8, 128), "qwen3moe-30b": (32, 4, 128)}
DOTS = (None, "exact", "native")  # the FMA split, the tensor-core split's two precisions


def _time(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print("| shape | keys m (real) | keys/step x warps | us per call | max err |")
    print("|---|---|---|---:|---:|")
    for name, (h, kvh, d) in SHAPES.items():
        for m, real in ((256, 100), (1024, 513), (4096, 4000)):
            blocks = m // 16 + 1
            kc = torch.randn(blocks, 16, kvh, d, generator=gen).half().cuda()
            vc = torch.randn(blocks, 16, kvh, d, generator=gen).half().cuda()
            q = torch.randn(1, h, d, generator=gen).cuda()
            slots = torch.randperm(blocks * 16, generator=gen)[:m].cuda()
            pad = torch.arange(m).cuda() >= real
            slots = torch.where(pad, slots[0], slots)
            plan = DecodePlan(
                torch.zeros(1, dtype=torch.long).cuda(), slots[None], pad[None, None, None]
            )
            ref = decode_attention(q.double(), kc.double(), vc.double(), plan, d**-0.5)
            for dot, bj, warps in itertools.product(DOTS, (None, 16, 32, 64), (4, 8)):
                if bj == 64 and dot is None:  # the FMA split's product does not fit registers
                    continue
                run = partial(flash_decode, q, kc, vc, plan, d**-0.5, None, None, bj, warps, dot)
                err = (run().double() - ref).abs().max().item()
                us = _time(run)
                label = f"{dot or 'fma'} {bj or 'auto'} x {warps}"
                print(f"| {name} | {m} ({real}) | {label} | {us:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
