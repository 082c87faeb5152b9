"""Batched decode's linears on the CPU: the native int8 row dots (what the native decode step and
`NativeLinear` run for few rows) against the exact path prompts take (the blocks decoded to fp32
tiles in C, then a GEMM), summed over every native linear of a model, at R rows a call.

The question (issue 39): should R concurrent decode rows take the prompt's GEMM path? The tiles
cost a decode of every weight per call whatever R is; the row dots cost grows with R. Each R
alternates the two paths `--rounds` times in one process (a busy box's load falls on both).

    python tests/perf/bench_rows_vs_tiles.py --model FILE [--rows 1 4 16 32 64] [--threads 2]
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from localllm.engine import loader
from localllm.kernels.quant.linear_native import NativeLinear
from localllm.kernels.quant.tiles import row_tiles


def natives(model) -> list[NativeLinear]:
    seen, out = set(), []
    for m in model.modules():
        kernels = [getattr(m, "_prepared", None)] + [k for k, _ in getattr(m, "_groups", ())]
        for k in kernels:
            if isinstance(k, NativeLinear) and id(k) not in seen:
                seen.add(id(k))
                out.append(k)
    return out


def rows_path(lin: NativeLinear, x: torch.Tensor) -> torch.Tensor:
    return lin.kernels.rows(lin.parts, lin.qtype, lin.shape[1], x)


def tiles_path(lin: NativeLinear, x: torch.Tensor) -> torch.Tensor:
    n, k = lin.shape
    y = torch.empty(x.shape[0], n)
    for r0, r1 in row_tiles(n, k):
        y[:, r0:r1] = F.linear(x, lin.kernels.dequant(lin.parts, lin.qtype, k, r0, r1))
    return y


def timed(path, lins, xs) -> float:
    t = time.perf_counter()
    for lin, x in zip(lins, xs, strict=True):
        path(lin, x)
    return (time.perf_counter() - t) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = loader.build_model(loader.open_weights(a.model))
    lins = natives(model)
    if not lins:
        print("no native linears (no C compiler?)", file=sys.stderr)
        return 1
    weights = sum(lin.shape[0] * lin.shape[1] for lin in lins)
    print(f"{a.model}: {len(lins)} native linears, {weights / 1e6:.1f}M weights, "
          f"{a.threads} threads")  # fmt: skip
    print("| rows | int8 row dots ms | fp32 tiles + GEMM ms | tiles / rows |")
    print("|---:|---|---|---:|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for r in a.rows:
            xs = [torch.randn(r, lin.shape[1], generator=gen) for lin in lins]
            timed(rows_path, lins, xs), timed(tiles_path, lins, xs)  # warm-up
            got: dict[str, list[float]] = {"rows": [], "tiles": []}
            for _ in range(a.rounds):
                got["rows"].append(timed(rows_path, lins, xs))
                got["tiles"].append(timed(tiles_path, lins, xs))
            mr, mt = statistics.median(got["rows"]), statistics.median(got["tiles"])
            print(f"| {r} | {' / '.join(f'{v:.1f}' for v in got['rows'])} | "
                  f"{' / '.join(f'{v:.1f}' for v in got['tiles'])} | {mt / mr:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
