"""A/B of how many token rows `moe_pairs` dots per decode of an expert's weight row (MOE_ROWS,
a compile-time macro of kernels/cpu/moe_gemv.c: 2 was the old kernel's pair, 4 its ROWS_MAX):
one Qwen3-30B-A3B-shaped MoE layer (128 experts of 2048 x 768, Q4_K gate / up, Q6_K down, top 8,
random ids: T * 8 / 128 rows an expert), each build in this process, alternating rounds, best
and median of 7 calls. The outputs must be equal bit for bit (a pair's sums do not depend on how
many pairs share its decode).

    python tests/perf/ab_moe_rows.py --tokens 64 --threads 2
"""

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from localllm.kernels.cpu import block_linear, native
from localllm.kernels.cpu.cbuild import build_library, compiler
from localllm.kernels.quant.types import QuantType as QT

DIM, HIDDEN, N_EXP, TOP_K = 2048, 768, 128, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="2,3,4", help="MOE_ROWS values to build")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    types = (QT.Q4_K, QT.Q4_K, QT.Q6_K)
    raws = [
        native.random_blocks(types[0], N_EXP * HIDDEN, DIM, rng).reshape(N_EXP, HIDDEN, -1),
        native.random_blocks(types[1], N_EXP * HIDDEN, DIM, rng).reshape(N_EXP, HIDDEN, -1),
        native.random_blocks(types[2], N_EXP * DIM, HIDDEN, rng).reshape(N_EXP, DIM, -1),
    ]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, DIM, generator=gen)
    ids = torch.stack([torch.randperm(N_EXP, generator=gen)[:TOP_K] for _ in range(a.tokens)])
    w = torch.softmax(torch.randn(a.tokens, TOP_K, generator=gen), -1)
    cc, out_dir = compiler(), Path(tempfile.mkdtemp(prefix="ab-moe-rows-"))
    kernels = {}
    for r in a.rows.split(","):
        flags = ("-O3", "-march=native", "-fopenmp", f"-DMOE_ROWS={r}")
        path = build_library(cc, flags, (native.SOURCE, *native.HEADERS), f"moe-r{r}", out_dir)
        lib = ctypes.CDLL(str(path))
        native._bind(lib)
        kernels[r] = native.NativeKernels(lib, path, flags, block_linear.load())
    outs = {}
    print(f"{a.tokens} tokens, {a.tokens * TOP_K / N_EXP:.1f} rows an expert, {a.threads} threads")
    for rnd in range(a.rounds):
        for r, k in kernels.items():
            k.moe_ffn(x, w, ids, *raws, types, threads=a.threads)
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                outs[r] = k.moe_ffn(x, w, ids, *raws, types, threads=a.threads)
                ts.append(time.perf_counter() - t0)
            ts.sort()
            print(f"round {rnd} MOE_ROWS={r}: best {ts[0] * 1e3:.2f} ms, median {ts[3] * 1e3:.2f}")
    first = next(iter(outs.values()))
    print("the same bits:", all(torch.equal(first, o) for o in outs.values()))


if __name__ == "__main__":
    main()
