"""Prompt attention on the H200 (run there; not a test): `triton_prefill.flash_prefill`'s launch
geometry and precision against the torch path it replaced (`paged.chunk_dense`:
a mask, SDPA's float32 math path), for the Llama-3-8B (32 q / 8 kv heads) and Qwen3-30B-A3B
(32 / 4) shapes, a fresh prompt of t tokens, f16 keys (the bench's cache; others with
`--keys`). Each variant is checked against a float64 reference first (max abs error printed).

    python tests/perf/bench_prefill_attention.py [--tokens 512,2048]
"""

import argparse
import itertools

import torch

from localllm.kernels.attention import paged
from localllm.kernels.attention.triton_prefill import BLOCKS, flash_prefill

SHAPES = {"llama3-8b": (32, 8, 128), "qwen3moe-30b": (32, 4, 128)}


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--keys", default="float16", help="key dtypes, comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    geos = list(itertools.product((32, 64, 128), (32, 64), (4, 8)))
    for (name, (h, kvh, d)), t, kdt in itertools.product(
        SHAPES.items(),
        (int(v) for v in args.tokens.split(",")),
        [getattr(torch, k) for k in args.keys.split(",")],
    ):
        gen = torch.Generator(device=dev).manual_seed(t)
        q = torch.randn(t, h, d, device=dev, generator=gen)
        keys = torch.randn(t, kvh, d, device=dev, generator=gen).to(kdt)
        vals = torch.randn(t, kvh, d, device=dev, generator=gen).to(kdt)
        scale = d**-0.5
        want = paged.chunk_dense(q.double(), keys, vals, 0, scale, None, None)
        old = _time(
            lambda q=q, k=keys, v=vals, s=scale: paged.chunk_dense(q, k, v, 0, s, None, None)
        )
        print(f"\n## {name} t {t} keys {kdt}: torch path {old:.1f} us")
        rows = []
        for (bm, bn, warps), dot in itertools.product(geos, ("tf32x3", "tf32")):

            def run(bm=bm, bn=bn, warps=warps, dot=dot, q=q, k=keys, v=vals, s=scale):
                return flash_prefill(q, k, v, 0, s, block=(bm, bn, warps), dot=dot)

            try:
                err = (run().double() - want).abs().max().item()
                us = _time(run)
            except Exception as exc:  # a geometry the compiler rejects (registers, shared memory)
                print(f"  bm {bm} bn {bn} w {warps} {dot}: {type(exc).__name__}")
                continue
            rows.append((us, bm, bn, warps, dot, err))
        rows.sort()
        for us, bm, bn, warps, dot, err in rows[:8]:
            print(f"  bm {bm:3d} bn {bn:2d} warps {warps} {dot:6s}: {us:7.1f} us  err {err:.1e}")
        for dot in ("tf32x3", "tf32"):
            best = [r for r in rows if r[4] == dot][:1]
            base = [r for r in rows if r[1:5] == (*BLOCKS[dot], dot)]
            for what, r in (("best", best), ("default", base)):
                if r:
                    us, bm, bn, warps, _, err = r[0]
                    print(f"  {dot} {what} ({bm}, {bn}, {warps}): {us:.1f} us  err {err:.1e}")


if __name__ == "__main__":
    main()
