"""Where a CPU prompt's time could go: `localllm bench -p P -n 0` in one process with the prompt
path as it is and with candidate changes patched in, alternating round by round (a busy box's
load falls on all alike). A measuring tool for changes not made yet, not a test.

Variants (each on top of "as is"):
- `flash`: attention of a chunk that starts the context (no cached keys, no image spans, a
  window the chunk does not reach) through SDPA's causal kernel instead of a boolean mask, which
  sends torch to its math path (a mask, a where, an all, bmm over repeated KV heads).
- `one_tile`: `NativeLinear` decodes a weight of up to 64 MiB of float32 as one tile and
  multiplies into the output, instead of tiles copied into output columns.
- `bf16`: the prompt GEMM in bfloat16 (tiles and rows rounded; oneDNN on AVX512-BF16): the
  speed a non-exact prompt path would have (the exact one is the project's rule).

    python tests/perf/prefill_variants.py -m FILE [-p 512] [-t 2] [--rounds 2] [--reps 2]
"""

import argparse
import contextlib
import io
import re
import sys

import torch
import torch.nn.functional as F

from localllm.app.bench import main as bench
from localllm.kernels.attention import paged
from localllm.kernels.quant import linear_native
from localllm.kernels.quant.tiles import row_tiles

ONE_TILE_BYTES = 64 << 20
_chunk_dense = paged.chunk_dense
_matmul = linear_native.NativeLinear.matmul


def flash_chunk(q, keys, vals, q0, scale, window, softcap, sinks=None, spans=None):
    t, m = q.shape[0], keys.shape[0]
    if q0 or m != t or spans or softcap is not None or sinks is not None or (window and t > window):
        return _chunk_dense(q, keys, vals, q0, scale, window, softcap, sinks, spans)
    qb, kb, vb = (
        q.transpose(0, 1),
        keys.to(q.dtype).transpose(0, 1),
        vals.to(q.dtype).transpose(0, 1),
    )
    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _gemm(self, x, dtype):
    n, k = self.shape
    x2 = x.reshape(-1, k).float().contiguous()
    if x2.shape[0] <= self.int8_max_t:
        return _matmul(self, x)
    xs = x2.to(dtype)
    if n * k * 4 <= ONE_TILE_BYTES:
        w = self.kernels.dequant(self.parts, self.qtype, k, 0, n)
        y = F.linear(xs, w.to(dtype)).float()
    else:
        y = torch.empty(x2.shape[0], n)
        for r0, r1 in row_tiles(n, k):
            w = self.kernels.dequant(self.parts, self.qtype, k, r0, r1)
            y[:, r0:r1] = F.linear(xs, w.to(dtype))
    return y.reshape(*x.shape[:-1], n)


VARIANTS = {
    "as is": {},
    "flash": {"attn": flash_chunk},
    "one_tile": {"mm": lambda self, x: _gemm(self, x, torch.float32)},
    "flash+one_tile": {"attn": flash_chunk, "mm": lambda self, x: _gemm(self, x, torch.float32)},
    "bf16": {"attn": flash_chunk, "mm": lambda self, x: _gemm(self, x, torch.bfloat16)},
}


def run(args, variant: str) -> float:
    v = VARIANTS[variant]
    paged.chunk_dense = v.get("attn", _chunk_dense)
    linear_native.NativeLinear.matmul = v.get("mm", _matmul)
    out = io.StringIO()
    argv = ["-m", args.model, "-p", str(args.p), "-n", "0", "-r", str(args.reps), "-t", str(args.t)]
    with contextlib.redirect_stdout(out):
        bench(argv)
    paged.chunk_dense, linear_native.NativeLinear.matmul = _chunk_dense, _matmul
    m = re.search(rf"pp{args.p}\s*\|\s*([\d.]+)", out.getvalue())
    return float(m.group(1)) if m else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    names = a.variants.split(",")
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            got[n].append(run(a, n))
            print(f"round {r + 1} {n}: pp{a.p} {got[n][-1]:.1f} t/s", file=sys.stderr)
    base = max(got["as is"]) if "as is" in got else None
    print(f"| variant | pp{a.p} t/s, rounds | best / as is |")
    print("|---|---|---|")
    for n, v in got.items():
        ratio = f"{max(v) / base:.2f}x" if base else ""
        print(f"| {n} | {' / '.join(f'{x:.1f}' for x in v)} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
