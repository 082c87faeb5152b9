"""Benchmark of MoE expert streaming on CPU: decode tokens/s against the expert slot count, next
to the disk's measured read bandwidth. Not a test.

It writes a synthetic qwen3moe GGUF (Q8_0 experts, random weights: routing is close to uniform,
the worst case for a cache), then for each slot count loads it with every expert on disk and
generates greedily, and once more with all experts resident. The file's pages are dropped from
the page cache (posix_fadvise DONTNEED) before each run, so the first read of an expert comes
from the disk; a re-read of an expert evicted from its slot may come from the page cache
(the kernel keeps what it read) - the `cold` column says how many bytes the runs read in all.

    python tests/perf/bench_moe.py [--layers 8] [--experts 64] [--dim 512] [--ff 1024]
        [--tokens 32] [--slots 1 2 4 8 16 32 64 128 512] [--evict lru lfu]
        [--prefetch on off] [--dir /tmp]

`guess` is the share of the experts the prefetch guessed (next layer's router on this layer's
input) that the layer then used; `ahead` the lookups served by a read-ahead.
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.offload.tiny_moe

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_stats import expert_stats
from localllm.offload.residency import resolve
from tests.offload.tiny_moe import MoESpec, write_moe_gguf


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(path: Path, chunk: int = 4 << 20) -> float:
    """GB/s of a cold sequential pread of the whole file."""
    drop_cache(path)
    buf = bytearray(chunk)
    fd = os.open(path, os.O_RDONLY)
    t0, total = time.perf_counter(), 0
    try:
        while n := os.preadv(fd, [buf], total):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def run(path: Path, layer: dict, tokens: int) -> dict:
    drop_cache(path)
    g = open_gguf(path)
    plan = plan_model(g, resolve([("bench", layer)]), kv_tokens=256)
    model = load_model(g, plan)
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stream = gen.stream([1, 17, 42, 99, 7, 3, 250, 64], params)
    out = [next(stream)]
    t0 = time.perf_counter()
    out += list(stream)
    dt = time.perf_counter() - t0
    for src in model.expert_sources:
        if hasattr(src, "close"):
            src.close()  # read-aheads still in flight finish and are counted
    s = expert_stats(model.expert_sources)
    g.close()
    return {"tok_s": (len(out) - 1) / dt, "stats": s, "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 512])
    ap.add_argument("--evict", nargs="+", default=["lru"], choices=("lru", "lfu"))
    ap.add_argument("--prefetch", nargs="+", default=["on"], choices=("on", "off"))
    ap.add_argument("--dir", default=None, help="folder for the model file (default: tmp)")
    ap.add_argument("--gguf", type=Path, default=None, help="an existing MoE GGUF instead")
    a = ap.parse_args()
    if a.gguf is not None:
        bench_file(a.gguf, a)
        return
    spec = MoESpec(
        n_layers=a.layers, dim=a.dim, n_heads=8, n_kv_heads=2, head_dim=a.dim // 8,
        n_expert=a.experts, n_used=a.used, expert_ff=a.ff, expert_qtype=QT.Q8_0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = write_moe_gguf(Path(d) / "bench_moe.gguf", spec)
        per_expert = 3 * a.dim * a.ff * 34 // 32
        print(
            f"# MoE streaming: {a.layers} layers x {a.experts} experts (top-{a.used}), "
            f"dim {a.dim}, expert ff {a.ff}, Q8_0; {spec.expert_nbytes / 2**20:.0f} MiB of "
            f"experts, {per_expert / 2**10:.0f} KiB each; {platform.machine()}, "
            f"torch threads {torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.1f}"
        )
        print(f"disk: cold sequential read {disk_bandwidth(path):.2f} GB/s ({path.parent})\n")
        sweep(path, a, a.layers * a.experts, per_expert)


def bench_file(path: Path, a) -> None:
    """The sweep over an existing MoE GGUF (e.g. `make_synthetic.py --shape qwen3moe-30b-a3b
    --layers 6`): its layer and expert counts and per-expert bytes from the file."""
    g = open_gguf(path)
    names = [n for n in g.tensors if "_exps." in n]
    layers = len({n.split(".")[1] for n in names})
    experts = g.weight(names[0]).shape[0]
    per_expert = sum(g.weight(n).nbytes for n in names) // (layers * experts)
    g.close()
    print(
        f"# MoE streaming: {path.name}, {layers} layers x {experts} experts, "
        f"{per_expert / 2**10:.0f} KiB each; {platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.1f}"
    )
    print(f"disk: cold sequential read {disk_bandwidth(path):.2f} GB/s ({path.parent})\n")
    sweep(path, a, layers * experts, per_expert)


def sweep(path: Path, a, total: int, per_expert: int) -> None:
    """All experts resident, then each slot count x eviction x read-ahead setting."""
    base = run(path, {"experts": "device"}, a.tokens)
    head = "| experts | slots | evict | prefetch | slot MiB | decode tok/s | hit rate | guess "
    print(head + "| ahead | read MB | GB/s | stall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| resident | - | - | - | - | {base['tok_s']:.1f} | 1.00 | - | - | 0 | - | 0 |")
    for slots in a.slots:
        if slots > total:
            continue
        for evict in a.evict:
            for pf in a.prefetch:
                st = {"slots": slots, "prefetch": pf == "on", "evict": evict}
                r = run(path, {"experts": "disk", "streaming": st}, a.tokens)
                assert r["tokens"] == base["tokens"], "streamed output differs from resident"
                s = r["stats"]
                print(
                    f"| disk | {slots} | {evict} | {pf} | {slots * per_expert / 2**20:.1f} "
                    f"| {r['tok_s']:.1f} | {s.hit_rate:.2f} | {s.guess_rate:.2f} | "
                    f"{s.prefetch_hits} | {s.bytes_read / 1e6:.0f} | {s.read_gbps:.2f} | "
                    f"{s.stall_seconds:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
