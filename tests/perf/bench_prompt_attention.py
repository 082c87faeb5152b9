"""CPU prompt attention alone: one layer's call over a T-row prompt chunk (random queries and a
paged cache), `kernels.attention.paged.CPU_PROMPT_ATTENTION`'s modes alternating call by call
("tiled": kernels/cpu/prompt_attention.c; "rows": the decode kernel row by row; "sdpa": torch),
minima over the rounds, at each thread count. Default shape: Llama-3.2-1B's attention (32 query
heads, 8 KV heads, head dim 64).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/bench_prompt_attention.py [-T 512] [--threads 2 1] [--rounds 5]
        [--heads 32 --kv-heads 8 --head-dim 64] [--kv f32 f16] [--modes tiled rows sdpa]
"""

import argparse
import os
import time
from pathlib import Path

import torch

from localllm.kernels.attention import paged

BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-T", type=int, default=512, help="prompt rows (and context)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv", nargs="+", default=["f32", "f16"], choices=["f32", "f16"])
    ap.add_argument("--modes", nargs="+", default=["tiled", "rows", "sdpa"])
    args = ap.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {load}; T={args.T}, {args.heads}/{args.kv_heads} heads, "
          f"head dim {args.head_dim}")  # fmt: skip
    t, hd = args.T, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, args.heads, hd, generator=gen)
    table = (tuple(range(-(-t // BS))),)
    flops = 4 * args.heads * hd * t * (t + 1) / 2  # QK and PV over the causal half
    for kv in args.kv:
        dtype = torch.float16 if kv == "f16" else torch.float32
        k, v = (torch.randn(len(table[0]), BS, args.kv_heads, hd, generator=gen).to(dtype)
                for _ in range(2))  # fmt: skip
        for threads in args.threads:
            torch.set_num_threads(threads)
            best = {}
            for _ in range(args.rounds + 1):  # (the first round warms up)
                for mode in args.modes:
                    paged.CPU_PROMPT_ATTENTION = mode
                    s = time.perf_counter()
                    paged.paged_attention(q, k, v, (0, t), (t,), table, hd**-0.5, prompt=(True,))
                    best[mode] = min(best.get(mode, 9e9), time.perf_counter() - s)
            cells = ", ".join(f"{m} {s * 1e3:.1f} ms ({flops / s / 1e9:.0f} GFLOP/s)"
                              for m, s in best.items())  # fmt: skip
            print(f"{kv} cache, {threads} threads: {cells}", flush=True)
    paged.CPU_PROMPT_ATTENTION = "tiled"


if __name__ == "__main__":
    main()
