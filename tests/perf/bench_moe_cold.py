"""Routed experts on the CPU with the weights coming from memory, not the cache: several
Qwen3-30B-A3B-shaped layers (gate/up Q4_K, down Q6_K, 128 experts, top-8; ~370 MB raw each)
rotated call by call, random experts per token, native kernels over the raw blocks against the
prepared torch path. Not a test.

    python tests/perf/bench_moe_cold.py [--threads 2] [--layers 4] [--rows 1 16 64] [--native-only]
        [--defines "PREFETCH_ROWS=8 PREFETCH_ROWS=16,PREFETCH_LOCALITY=3"] [--shape granite]

`--shape granite`: Granite-4.0-H-Tiny's experts instead (64 of 1536 x 512, top 6: ~1.5 MB an
expert against Qwen3's ~3 MB).

`--defines`: native builds with these -D settings besides the default one (space-separated
variants, comma-separated defines within one), each timed on the same layers.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from localllm.kernels.cpu.native import load as load_native
from localllm.kernels.moe import ExpertBlocks, ExpertFormat, expert_ffn_grouped
from localllm.kernels.moe.prepared import prepare_expert
from localllm.kernels.quant import QuantType
from tests.kernels.test_moe_prepared import expert_blocks

SHAPE_OF = {"qwen3moe": (2048, 768, 128, 8), "granite": (1536, 512, 64, 6)}  # dim, hidden, E, k
DIM, HIDDEN, E, TOP_K = SHAPE_OF["qwen3moe"]


def _set_shape(name: str) -> None:
    global DIM, HIDDEN, E, TOP_K, FMT, SHAPES
    DIM, HIDDEN, E, TOP_K = SHAPE_OF[name]
    FMT = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, DIM, HIDDEN)
    SHAPES = ((QT.Q4_K, HIDDEN, DIM), (QT.Q4_K, HIDDEN, DIM), (QT.Q6_K, DIM, HIDDEN))


_set_shape("qwen3moe")


def median_ms(run, layers: list, rows: int, calls: int, seed: int) -> float:
    """Median ms of `run(layer, x, weights, ids)` over `calls` calls, layers in rotation (the
    first len(layers) calls warm up)."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    for i in range(calls + len(layers)):
        x = torch.randn(rows, DIM, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(rows)])
        w = torch.softmax(torch.randn(rows, TOP_K, generator=gen), -1)
        t0 = time.perf_counter()
        run(layers[i % len(layers)], x, w, ids)
        if i >= len(layers):
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--native-only", action="store_true", help="skip the prepared torch path")
    ap.add_argument("--defines", default="", help="native build variants (see the docstring)")
    ap.add_argument("--shape", choices=sorted(SHAPE_OF), default="qwen3moe")
    a = ap.parse_args()
    _set_shape(a.shape)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    raw = [[torch.from_numpy(expert_blocks(q, E, r, c, rng)) for q, r, c in SHAPES]
           for _ in range(a.layers)]  # fmt: skip
    native = load_native()
    prepared = [[prepare_expert(ExpertBlocks(g[e], u[e], d[e]), FMT) for e in range(E)]
                for g, u, d in raw] if not a.native_only else None  # fmt: skip
    types = (FMT.gate, FMT.up, FMT.down)
    mb = sum(t.numel() for t in raw[0]) / 1e6
    flags = native and " ".join(native.flags)
    print(f"# {a.layers} layers of {E} experts ({mb:.0f} MB raw each), {a.threads} threads, "
          f"native flags {flags}")  # fmt: skip
    variants = list(_variants(a.defines))
    for (label, k), _ in itertools.product(variants, range(2)):  # (twice: the first one warms)
        for rows in a.rows:
            ms = median_ms(lambda L, x, w, i, k=k: k.moe_ffn(x, w, i, *L, types), raw, rows,
                           a.calls, rows)  # fmt: skip
            print(f"rows {rows:3d}: native {label} {ms:8.2f} ms per layer call")
    for rows in a.rows:
        nat = median_ms(lambda L, x, w, i: native.moe_ffn(x, w, i, *L, types), raw, rows,
                        a.calls, rows) if native else float("nan")  # fmt: skip
        prep = median_ms(lambda P, x, w, i: expert_ffn_grouped(x, w, i, P.__getitem__, FMT),
                         prepared, rows, a.calls, rows) if prepared else float("nan")  # fmt: skip
        print(f"rows {rows:3d}: native {nat:8.2f} ms, prepared {prep:8.2f} ms per layer call")


def _variants(defines: str):
    """(label, NativeKernels) for each -D variant that builds and passes the self-check."""
    import tempfile

    from localllm.kernels.cpu import native as nat
    from localllm.kernels.cpu.cbuild import built_libraries

    for v in defines.split():
        flags = (*nat.FLAG_SETS[0], *(f"-D{d}" for d in v.split(",")))
        for lib, path, fl in built_libraries((nat.SOURCE, *nat.HEADERS), (flags,),
                                             "localllm-moe-gemv-variant", nat._bind,
                                             Path(tempfile.gettempdir()) / "variants"):  # fmt: skip
            k = nat.NativeKernels(lib, path, fl)
            if nat.self_check(k):
                yield v, k
            else:
                print(f"# {v}: failed the self-check")


if __name__ == "__main__":
    main()
