"""CPU batched decode, A/B of the native kernels' C sources: this tree's `decode_step.c` (its
block linears inside) against the same files at an older git revision, both compiled side by
side and alternated call by call on one `DecodeStep` of a real model (a busy box's load falls on
both alike), t token rows of `--ctx` context each (random float16 KV), plus the output head's
shape through `block_rows` (random blocks of its type). Prints medians and minima of each, and
whether the two give the same bits.

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_decode_step.py --model FILE --old-rev REV [--rows 1 4 16] [--ctx 96]
        [--threads 2] [--rounds 15] [--old-defines=-DPREFETCH_ROWS=4]
    python tests/perf/ab_decode_step.py --old-rev REV --shapes Q4_K:256:2048 Q6_K:256:2048
        [--rows 1] [--threads 1]

`--old-rev tree` with `--old-defines` compares a build variant of this tree against its default.
`--shapes` times `block_rows` alone on random blocks of those shapes (no model): shapes that fit
the caches measure the dots' arithmetic, which a busy box disturbs least.
"""

import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from localllm.engine import loader
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.cpu import block_linear
from localllm.kernels.cpu import decode_step as ds
from localllm.kernels.cpu.cbuild import built_libraries
from localllm.kernels.quant import QuantType

FILES = ("decode_step.c", "block_linear.c", "block_dequant.h", "block_dots.h", "quant_dots.h",
         "i16_gemm.h", "i8_gemm.h", "decode_moe.h", "decode_lora.h", "recurrent_rows.h",
         "decode_attention.h")  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def old_library(
    rev: str, out: Path, new: ctypes.CDLL, defines: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """The step's library from the sources at `rev` (`tree`: this checkout's files), built with
    the tree's fastest flags and `defines` (e.g. -DPREFETCH_ROWS=4: a build variant); bound
    like `new` for the two calls timed here (an older revision lacks later prompt GEMMs)."""

    def bind(lib: ctypes.CDLL) -> None:
        for name in ("block_rows", "decode_step"):
            f, g = getattr(lib, name), getattr(new, name)
            f.argtypes, f.restype = g.argtypes, g.restype

    for name in FILES:
        if rev == "tree":
            text = (ROOT / "kernels" / "cpu" / name).read_bytes()
        else:  # (a file the revision lacks is left empty: its sources do not include it)
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/cpu/{name}"],
                                  capture_output=True, check=name == FILES[0]).stdout  # fmt: skip
        (out / name).write_bytes(text)
    flags = (block_linear.FLAG_SETS[0] + tuple(defines),)
    built = built_libraries(tuple(out / n for n in FILES), flags, "ab-old-step", bind, out)
    return next(built)[0]


def alternate(run, libs: dict, rounds: int) -> dict:
    """{name: (median ms, min ms, last result)}, the libraries taking turns call by call."""
    times: dict[str, list[float]] = {n: [] for n in libs}
    last = {}
    for r in range(rounds):
        for name in list(libs) if r % 2 == 0 else list(libs)[::-1]:
            t0 = time.perf_counter()
            last[name] = run(libs[name])
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: (statistics.median(v), min(v), last[n]) for n, v in times.items()}


def step_call(step, x0, args, threads, lib):
    step.lib, x = lib, x0.clone()
    return step(x, *args, threads=threads)


def head_call(qt, parts, x, n, threads, lib, reps=1):
    t, k = x.shape
    y, q8 = torch.empty(t, n), torch.empty(t * k, dtype=torch.int8)
    d8, bs = torch.empty(t * k // 32 + 8), torch.empty(t * k // 16 + 16, dtype=torch.int16)
    p = torch.Tensor.data_ptr
    for _ in range(reps):
        lib.block_rows(qt.value, len(parts), parts.ptrs, parts.rows, k, t, p(x), p(y), p(q8),
                       p(d8), p(bs), threads)  # fmt: skip
    return y


def shape_rows(spec: str, rows: list[int], libs: dict, threads: int, rounds: int) -> None:
    """block_rows on random blocks of `spec` (TYPE:N:K), each timed call ~64 MiB of weight reads
    (a matrix that fits the caches measures the dots' arithmetic alone, as on a busy box)."""
    name, n, k = spec.split(":")
    qt, n, k = QuantType[name], int(n), int(k)
    parts = block_linear.Parts([block_linear.random_blocks(qt, n, k, np.random.default_rng(0))])
    nbytes = parts.parts[0].numel()
    reps = max(1, (64 << 20) // nbytes)
    for t in rows:
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        run = functools.partial(head_call, qt, parts, x, n, threads, reps=reps)
        res = alternate(run, libs, rounds)
        gib = {v: nbytes * reps / (res[v][1] / 1e3) / 2**30 for v in ("old", "new")}
        report(f"{spec} x{reps}, {t} rows (best {gib['old']:.1f} / {gib['new']:.1f} GiB/s)", res)


def report(what: str, res: dict) -> None:
    (mo, lo, yo), (mn, ln, yn) = res["old"], res["new"]
    same = torch.equal(yo, yn)
    print(f"| {what} | {mo:.2f} / {lo:.2f} | {mn:.2f} / {ln:.2f} | {mn / mo:.3f} | {same} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--old-rev", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ctx", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--old-defines", nargs="*", default=[], help="-D flags of the old build")
    ap.add_argument("--shapes", nargs="*", default=[], help="TYPE:N:K block_rows only, no model")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ab-step-"))
    new = ds.load()
    libs = {"old": old_library(a.old_rev, tmp, new, tuple(a.old_defines)), "new": new}
    if a.shapes:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, old {a.old_rev}, "
              f"threads {a.threads}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
        print("| call | old median / min ms | new median / min ms | new / old | same bits |")
        print("|---|---|---|---|---|")
        for spec in a.shapes:
            shape_rows(spec, a.rows, libs, a.threads, a.rounds)
        return
    if not a.model:
        ap.error("--model FILE (or --shapes)")
    model = loader.build_model(loader.open_weights(a.model))
    nd = NativeDecode.for_model(model)
    head = getattr(getattr(model, "output", None), "_prepared", None)  # a NativeLinear
    layers, kvh, hd = model.kv_shape()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, old {a.old_rev} "
          f"{' '.join(a.old_defines)}, "
          f"threads {a.threads}, ctx {a.ctx}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| call | old median / min ms | new median / min ms | new / old | same bits |")
    print("|---|---|---|---|---|")
    for t in a.rows:
        bpr = (a.ctx + 15) // 16 + 1
        kv = PagedKVCache(layers, t * bpr + 1, 16, kvh, hd, "f16", "cpu")
        for i in range(layers):
            kv.k[i].normal_(), kv.v[i].normal_()
        step = nd._for_cache(kv)
        g = torch.Generator().manual_seed(t)
        x0 = torch.randn(t, nd.shape.dim, generator=g)
        ang = torch.rand(t, nd.shape.rope_dims // 2, generator=g) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        tables = torch.arange(t * bpr, dtype=torch.int64).view(t, bpr).contiguous()
        lens = torch.full((t,), a.ctx, dtype=torch.int64)
        slots = (tables[:, (a.ctx - 1) // 16] * 16 + (a.ctx - 1) % 16).contiguous()
        run = functools.partial(step_call, step, x0, (cos, sin, slots, lens, tables), a.threads)
        report(f"step, {t} rows", alternate(run, libs, a.rounds))
    qt = QuantType(int(head.qtype)) if head is not None else QuantType.Q8_0
    n, k = head.shape if head is not None else (49152, 576)
    parts = block_linear.Parts([block_linear.random_blocks(qt, n, k, np.random.default_rng(0))])
    for t in a.rows:
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        run = functools.partial(head_call, qt, parts, x, n, a.threads)
        report(f"head {qt.name} [{n}, {k}], {t} rows", alternate(run, libs, a.rounds))


if __name__ == "__main__":
    main()
