"""One decode step as the engine runs it on a GPU, kernel by kernel (run on the H200; not a test).

    python tests/perf/graph_step.py MODEL [DEPTH] [--no-pdl]

Prefills DEPTH random tokens, then replays the captured single-sequence decode graph
(`engine.runtime.cuda_graphs.DecodeGraphs`, flash-decoding attention) under the torch profiler: the
kernels of a replay, their GPU time and count, and the replay's wall time from CUDA events. The
eager `bench_gpu.py breakdown` runs another attention path and pays host time per op; this is
the step `localllm bench` measures. Under programmatic dependent launch (`kernels/pdl.py`, on by
default on sm_90+) a kernel's programs wait on the SMs for their predecessor, so the profiler's
per-kernel times include that wait; `--no-pdl` launches without it for a kernel-by-kernel split.
"""

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.cuda_graphs import DecodeGraphs, pack_decode
from localllm.engine.runtime.kv_cache import PagedKVCache

BS = 16


def main(path: str, depth: int = 512) -> None:
    gg = open_gguf(path)
    model = build_model(gg, device="cuda")
    layers, kvh, hd = model.kv_shape()
    blocks = depth // BS + 2
    kv = PagedKVCache(layers, blocks, BS, kvh, hd, "f16", "cuda", model.kv_value_dim())
    table = list(range(blocks))
    with torch.inference_mode():
        b = BatchMeta.contiguous(depth, depth, BS)
        b = BatchMeta(b.query_start, b.seq_lens, b.block_tables, b.slot_mapping.cuda(), BS)
        ids = torch.randint(0, model.args.vocab_size, (depth,), device="cuda")
        model(ids, torch.arange(depth, device="cuda"), b, kv)
        graphs = DecodeGraphs(model, kv)
        rows = pack_decode([1], [depth], [depth], [table]).cuda()
        for _ in range(5):
            assert graphs.run(rows) is not None, graphs.failed
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            graphs.run(rows)
        e1.record()
        torch.cuda.synchronize()
        step_ms = e0.elapsed_time(e1) / 50
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.run(rows)
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", 0)
        if t > 0:
            kernels[evt.key[:60]][0] += t / 1e3
            kernels[evt.key[:60]][1] += evt.count
    busy = sum(v[0] for v in kernels.values())
    launches = sum(v[1] for v in kernels.values())
    print(f"graph decode step at depth {depth}: {step_ms:.3f} ms per replay "
          f"({1e3 / step_ms:.1f} t/s); kernels {launches}, GPU busy {busy:.3f} ms, "
          f"gaps {step_ms - busy:.3f} ms")  # fmt: skip
    print("| kernel | launches | GPU ms | us per launch |")
    print("|---|---:|---:|---:|")
    for key, (ms, n) in sorted(kernels.items(), key=lambda kv_: -kv_[1][0]):
        print(f"| {key} | {n} | {ms:.3f} | {1e3 * ms / max(n, 1):.1f} |")
    gg.close()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-pdl"]
    if "--no-pdl" in sys.argv:
        from localllm.kernels import pdl

        pdl.enabled = lambda t: False  # every launch site asks this function
    main(args[0], *(int(a) for a in args[1:]))
