"""CPU decode with the weights' file mapped on 4 KiB pages, on 2 MiB pages (the loader's
`offload.ranges.HUGE_PAGES` advice: the page cache's 2 MiB folios mapped by one entry each, no
copy), and copied into anonymous transparent huge pages: the same model loaded three times, the
one-row native decode step and the output head alternating between them call by call. The
hardware prefetchers stop at every 4 KiB page and each 4 KiB entry is a TLB miss in the stream.

The file mapping gets 2 MiB entries only where the page cache holds the file in 2 MiB folios:
a file cached by writes or reads through small folios stays small until dropped. `--evict`
drops the file's unmapped cached pages first (posix_fadvise DONTNEED), so the 2 MiB variant
reads it back in 2 MiB folios. Each variant's mapping is reported (Rss, FilePmdMapped from
/proc/self/smaps), with the process' AnonHugePages and peak RSS. `--small-folios COPY` adds a
byte-identical file whose page cache holds 4 KiB folios (written or read through small folios,
check with /proc/kpageflags): on 4 KiB entries too, but physically scattered, where the
same-file 4 KiB variant's entries cover contiguous 2 MiB folios (which some cores' TLBs coalesce).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_hugepages.py --model FILE [--threads 2] [--rounds 21] [--evict]
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
from localllm.offload import ranges

HUGE = 2 << 20


def build(path: str, pages: bool, copy: bool):
    """(step, head, the region kept alive, the GGUF) of a fresh model; `pages`: the loader's
    huge-page advice for its mapping; `copy`: its linears copied into anonymous huge pages."""
    ranges.HUGE_PAGES = pages
    gguf = loader.open_weights(path)
    model = loader.build_model(gguf)
    nd = NativeDecode.for_model(model)
    if nd is None:
        raise SystemExit(f"{path}: no native decode step for this model")
    head = model.output._prepared
    lins = [lin for lay in nd.layers
            for lin in (*lay["qkv"], lay["o"], *lay["gate_up"], lay["down"])] + [head]  # fmt: skip
    region = None
    if copy:
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
    return nd, nd._for_cache(kv), head, region, gguf


def mapping(addr: int, size: int) -> str:
    """Rss and FilePmdMapped (kB) of the mapping at [addr, addr + size), over every part that
    madvise split it into (the loader's 4 KiB token_embd)."""
    out, found = {"Rss": 0, "FilePmdMapped": 0}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = addr <= int(head.split("-")[0], 16) < addr + size
            elif found and head in ("Rss:", "FilePmdMapped:"):
                out[head[:-1]] += int(line.split()[1])
    return f"Rss {out['Rss']:,} kB, FilePmdMapped {out['FilePmdMapped']:,} kB"


def status(key: str) -> str:
    with open("/proc/self/status") as f:
        return next(ln.split(":")[1].strip() for ln in f if ln.startswith(key))


def smaps_rollup(key: str) -> str:
    with open("/proc/self/smaps_rollup") as f:
        return next(ln.split(":")[1].strip() for ln in f if ln.startswith(key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--evict", action="store_true", help="drop the file's cached pages first")
    ap.add_argument("--small-folios", metavar="COPY", help="a fourth variant: a byte-identical "
                    "file cached in 4 KiB folios")  # fmt: skip
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.evict:
        fd = os.open(a.model, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    # the 2 MiB variant first: if the file is read now, it comes in under the huge-page advice
    variants = {"file 2 MiB": build(a.model, True, False)}
    variants["file 4 KiB"] = build(a.model, False, False)
    variants["anon copy 2 MiB"] = build(a.model, False, True)
    if a.small_folios:
        variants["small-folio file 4 KiB"] = build(a.small_folios, False, False)
    ranges.HUGE_PAGES = True
    nd = variants["file 4 KiB"][0]
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

    base = variants["file 4 KiB"]
    same = all(torch.equal(f(base), f(v)) for v in variants.values() for f in (step, head))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.model} "
          f"({os.path.getsize(a.model):,} bytes), threads {a.threads}, load "
          f"{os.getloadavg()[0]:.2f}, same bits {same}")  # fmt: skip
    for name, v in variants.items():
        mf = v[4].mapped_file(v[4].path)
        addr = mf.view(ranges.ByteRange(mf.path, 0, 1)).data_ptr()
        print(f"# {name}: advice taken {mf.huge_pages}, mapping {mapping(addr, mf.size)}")
    print(
        f"# process: AnonHugePages {smaps_rollup('AnonHugePages')}, peak RSS "
        f"{status('VmHWM')} (the anonymous part is the copy)"
    )
    layer_bytes = sum(lin.nbytes for lay in nd.layers
                      for lin in (*lay["qkv"], lay["o"], *lay["gate_up"], lay["down"]))  # fmt: skip
    head_bytes = base[2].nbytes
    for name, fn, nbytes in (("step", step, layer_bytes), ("head", head, head_bytes)):
        times = {v: [] for v in variants}
        for r in range(a.rounds):
            for v in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                t0 = time.perf_counter()
                fn(variants[v])
                times[v].append(time.perf_counter() - t0)
        for v, ts in times.items():
            print(f"| {name}, {v} | {statistics.median(ts) * 1e3:.2f} / "
                  f"{min(ts) * 1e3:.2f} ms | {nbytes / min(ts) / 2**30:.1f} GiB/s |")  # fmt: skip
    print(f"# load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
