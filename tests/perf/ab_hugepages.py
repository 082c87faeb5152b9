"""CPU decode with the weights in the file's mapping against a copy in anonymous transparent
huge pages: the same model loaded twice, the second's native linears moved into one
`MADV_HUGEPAGE` region (2 MiB aligned), the one-row native decode step and the output head
alternating between the two call by call. The hardware prefetchers stop at every 4 KiB page and
the file is mapped with 4 KiB entries (the page cache's 2 MiB folios are not PMD-mapped here);
this asks whether huge pages would stream the weights faster.

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_hugepages.py --model FILE [--threads 2] [--rounds 21]
"""

import argparse
import mmap
import os
import statistics
import time

import torch

from localllm.engine import loader
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.runtime.kv_cache import PagedKVCache

HUGE = 2 << 20


def build(path: str, huge: bool):
    """(step, head, the region kept alive) of a fresh model; `huge`: its linears copied."""
    model = loader.build_model(loader.open_weights(path))
    nd = NativeDecode.for_model(model)
    if nd is None:
        raise SystemExit(f"{path}: no native decode step for this model")
    head = model.output._prepared
    lins = [lin for lay in nd.layers
            for lin in (*lay["qkv"], lay["o"], *lay["gate_up"], lay["down"])] + [head]  # fmt: skip
    region = None
    if huge:
        size = sum((p.numel() + 4095) & ~4095 for lin in lins for p in lin.parts.parts)
        region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(region, dtype=torch.uint8)
        at = -whole.data_ptr() % HUGE
        for lin in lins:
            moved = []
            for p in lin.parts.parts:
                moved.append(whole[at : at + p.numel()].view(p.shape).copy_(p))
                at += (p.numel() + 4095) & ~4095
            lin.parts = lin.kernels.parts(moved)
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, 8, 16, kvh, hd, "f16", "cpu")
    gen = torch.Generator().manual_seed(0)
    for i in range(layers):
        kv.k[i].copy_(torch.randn(kv.k[i].shape, generator=gen))
        kv.v[i].copy_(torch.randn(kv.v[i].shape, generator=gen))
    return nd, nd._for_cache(kv), head, region


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    variants = {"4 KiB": build(a.model, False), "huge": build(a.model, True)}
    nd = variants["4 KiB"][0]
    s, g = nd.shape, torch.Generator().manual_seed(1)
    x0, xh = torch.randn(1, s.dim, generator=g), torch.randn(1, s.dim, generator=g)
    ang = torch.rand(1, s.rope_dims // 2, generator=g) * 6.28
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    tables = torch.arange(7, dtype=torch.int64).view(1, 7)
    lens = torch.full((1,), 96, dtype=torch.int64)
    slots = (tables[:, 95 // 16] * 16 + 95 % 16).contiguous()

    def step(v):
        return v[1](x0.clone(), cos, sin, slots, lens, tables, threads=a.threads)

    def head(v):
        h = v[2]
        return h.kernels.rows(h.parts, h.qtype, h.shape[1], xh, threads=a.threads)

    with open("/proc/self/smaps_rollup") as f:
        huge_kib = [ln.split()[1] for ln in f if "AnonHuge" in ln]
    same = all(torch.equal(f(variants["4 KiB"]), f(variants["huge"])) for f in (step, head))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.model}, threads "
          f"{a.threads}, load {os.getloadavg()[0]:.2f}, AnonHugePages {huge_kib[0]} kB, "
          f"same bits {same}")  # fmt: skip
    layer_bytes = sum(lin.nbytes for lay in nd.layers
                      for lin in (*lay["qkv"], lay["o"], *lay["gate_up"], lay["down"]))  # fmt: skip
    head_bytes = variants["huge"][2].nbytes
    for name, fn, nbytes in (("step", step, layer_bytes), ("head", head, head_bytes)):
        times = {v: [] for v in variants}
        for r in range(a.rounds):
            for v in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                t0 = time.perf_counter()
                fn(variants[v])
                times[v].append(time.perf_counter() - t0)
        for v, ts in times.items():
            print(f"| {name}, {v} pages | {statistics.median(ts) * 1e3:.2f} / "
                  f"{min(ts) * 1e3:.2f} ms | {nbytes / min(ts) / 2**30:.1f} GiB/s |")  # fmt: skip
    print(f"# load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
