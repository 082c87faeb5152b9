"""How fast the expert streamer's reads can go on this host: random experts of a MoE GGUF read
with the streamer's own cut (`offload.reader.shares`, one contiguous share per thread) into one
page-locked (CUDA) or plain buffer, by thread count; each set read twice (the second pass comes
from the page cache if the file fits there). Prints what the kernel says about memory first.

    python tests/perf/bench_pread.py MODEL.gguf [--experts 64] [--threads 1 2 4 8 16]
"""

import argparse
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from gguf import GGUFReader

from localllm.offload.reader import pread_all, shares

EXPS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def expert_ranges(path: str) -> dict[int, list[tuple[int, int]]]:
    """layer -> [(offset, bytes of one expert)] for gate, up, down, and the expert count."""
    layers: dict[int, dict[str, tuple[int, int, int]]] = {}
    for t in GGUFReader(path).tensors:
        m = EXPS.fullmatch(t.name)
        if m:
            n_expert = int(t.shape[-1])
            layers.setdefault(int(m[1]), {})[m[2]] = (
                t.data_offset,
                t.n_bytes // n_expert,
                n_expert,
            )
    return {k: [v[p] for p in ("gate", "up", "down")] for k, v in layers.items()}


def meminfo() -> str:
    keys = ("MemTotal", "MemAvailable", "Cached")
    with open("/proc/meminfo") as f:
        rows = [line.split()[:2] for line in f if line.split(":")[0] in keys]
    out = ", ".join(f"{k.rstrip(':')} {int(v) / 2**20:.1f} GiB" for k, v in rows)
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        if os.path.exists(p):
            with open(p) as f:
                out += f", cgroup limit {f.read().strip()}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    print(meminfo())
    layers = expert_ranges(args.model)
    rng = random.Random(0)
    one = sum(n for _, n, _ in next(iter(layers.values())))
    pin = torch.cuda.is_available()
    buf = torch.empty(args.experts, one, dtype=torch.uint8, pin_memory=pin)
    view = memoryview(buf.numpy()).cast("B")
    fd = os.open(args.model, os.O_RDONLY)
    print(f"{len(layers)} layers, {one / 1e6:.2f} MB per expert, buffer pinned: {pin}")
    print("| threads | pass 1 GB/s | pass 2 GB/s |\n|---:|---:|---:|")
    for threads in args.threads:
        picks = [
            (rng.choice(list(layers)), rng.randrange(layers[0][0][2])) for _ in range(args.experts)
        ]
        reads, pos = [], 0
        for layer, e in picks:
            for off, n, _ in layers[layer]:
                reads.append((fd, view[pos : pos + n], off + e * n, args.model))
                pos += n
        parts = shares(reads, threads)
        rates = []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(2):
                t0 = time.perf_counter()
                list(pool.map(pread_all, parts))
                rates.append(pos / (time.perf_counter() - t0) / 1e9)
        print(f"| {threads} | {rates[0]:.2f} | {rates[1]:.2f} |")
    os.close(fd)
    print(meminfo())


if __name__ == "__main__":
    main()
