"""Where one CPU decode step's time goes, against the machine's memory bandwidth: the native step
(`kernels/cpu/decode_step.c`, one token row, `--ctx` keys of random float16 KV) timed whole,
then its parts as separate calls of the same library at the same thread count: every layer's
linears through `block_rows` (summed per ggml type), its attention through `paged_decode`, and
the output head; "rest" is the step less its linears and attention (norms, rope, KV writes, the
gate product, barriers). Beside them the weight bytes each part reads and the rate, and the
machine's copy / read bandwidth at the same thread count (torch copy_ and sum over 1 GiB).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md. Rounds alternate the parts, so a shared box's load falls on all.

    python tests/perf/profile_cpu_step.py --model FILE [--threads 2] [--ctx 96] [--rounds 15]
"""

import argparse
import os
import statistics
import time

import torch

from localllm.engine import loader
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.cpu import paged_decode

GIB = 2**30


def timed(fn, out: list) -> None:
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)


def bandwidth(threads: int, rounds: int, nbytes: int = GIB) -> tuple[float, float]:
    """(copy GiB/s counting the bytes copied once, read GiB/s) at `threads`, best of `rounds`."""
    torch.set_num_threads(threads)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy, read = [], []
    for _ in range(rounds):
        timed(lambda: dst.copy_(src), copy)
        timed(lambda: src.sum(), read)
    return nbytes / min(copy) / GIB, nbytes / min(read) / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.model}, threads "
          f"{a.threads}, ctx {a.ctx}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    model = loader.build_model(loader.open_weights(a.model))
    nd = NativeDecode.for_model(model)
    if nd is None:
        raise SystemExit(f"{a.model}: no native decode step for this model")
    s = nd.shape
    layers, kvh, hd = model.kv_shape()
    bpr = (a.ctx + 15) // 16 + 1
    kv = PagedKVCache(layers, bpr + 1, 16, kvh, hd, "f16", "cpu")
    for i in range(layers):
        kv.k[i].normal_(), kv.v[i].normal_()
    step = nd._for_cache(kv)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, s.dim, generator=g)
    ang = torch.rand(1, s.rope_dims // 2, generator=g) * 6.28
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    tables = torch.arange(bpr, dtype=torch.int64).view(1, bpr)
    lens = torch.full((1,), a.ctx, dtype=torch.int64)
    slots = (tables[:, (a.ctx - 1) // 16] * 16 + (a.ctx - 1) % 16).contiguous()

    # the parts: (name, weight bytes, call); linears of one type summed over the layers
    linears: dict[str, list] = {}
    for lay in nd.layers:
        for lin, k in [*((q, s.dim) for q in lay["qkv"]), (lay["o"], s.n_q * s.head_dim),
                       *((u, s.dim) for u in lay["gate_up"]), (lay["down"], s.hidden)]:  # fmt: skip
            linears.setdefault(lin.qtype.name, []).append((lin, k))
    xs = {k: torch.randn(1, k, generator=g) for k in {s.dim, s.n_q * s.head_dim, s.hidden}}

    def run_linears(items):
        for lin, k in items:
            lin.kernels.rows(lin.parts, lin.qtype, k, xs[k], threads=a.threads)

    q = torch.randn(1, s.n_q, s.head_dim, generator=g)

    def run_attention():
        for i in range(layers):
            paged_decode.paged_decode(q, kv.k[i], kv.v[i], lens, tables, hd**-0.5, None, a.threads)

    head = getattr(getattr(model, "output", None), "_prepared", None)
    layer_bytes = sum(lin.nbytes for it in linears.values() for lin, _ in it)
    parts = {"step": (layer_bytes, lambda: step(x0.clone(), cos, sin, slots, lens, tables,
                                                threads=a.threads))}  # fmt: skip
    for name, items in sorted(linears.items()):
        parts[f"{name} linears"] = (sum(lin.nbytes for lin, _ in items),
                                    lambda items=items: run_linears(items))  # fmt: skip
    parts["attention"] = (0, run_attention)
    if head is not None:
        xh = torch.randn(1, head.shape[1], generator=g)
        parts[f"head {head.qtype.name}"] = (
            head.nbytes, lambda: head.kernels.rows(head.parts, head.qtype, head.shape[1], xh,
                                                   threads=a.threads))  # fmt: skip
    times: dict[str, list] = {n: [] for n in parts}
    for _ in range(2):  # warm: the weights' pages in, the scratch grown
        for _, fn in parts.values():
            fn()
    for r in range(a.rounds):
        for name in list(parts) if r % 2 == 0 else list(parts)[::-1]:
            timed(parts[name][1], times[name])
    copy, read = bandwidth(a.threads, 5)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    low = {n: min(v) * 1e3 for n, v in times.items()}
    inner = [n for n in parts if n.endswith("linears") or n == "attention"]
    print(f"machine: copy {copy:.1f} GiB/s, read {read:.1f} GiB/s at {a.threads} threads")
    print("| part | median / min ms | share of the step (median) | weights MiB | GiB/s (min) |")
    print("|---|---|---|---|---|")
    for n, (nbytes, _) in parts.items():
        rate = f"{nbytes / (low[n] / 1e3) / GIB:.1f}" if nbytes else "-"
        share = f"{med[n] / med['step']:.0%}" if n in inner else "-"
        print(f"| {n} | {med[n]:.2f} / {low[n]:.2f} | {share} | {nbytes / 2**20:.0f} | {rate} |")
    rest = med["step"] - sum(med[n] for n in inner)
    print(f"| rest (step less its linears and attention) | {rest:.2f} | "
          f"{rest / med['step']:.0%} | - | - |")  # fmt: skip
    print(f"# load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
