"""Where one decode step's time goes, kernel by kernel, against the memory-bandwidth floor.

    python tests/perf/decode_kernels.py MODEL.gguf [--depth 512,8192] [--steps 20] [--lora A.gguf]

For each depth: DEPTH random tokens are prefilled, then the single-sequence decode graph that
`localllm serve` and `localllm bench` replay (`engine.runtime.cuda_graphs.DecodeGraphs`) is timed
(CUDA events over 50 replays: the step time as shipped). It is captured again without
programmatic dependent launch, timed, and profiled (torch.profiler, CUDA activity, over --steps
replays): under PDL a kernel's programs wait on the SMs for the one before, so the profiler's
per-kernel times would add up to several steps (tests/perf/results/gpu-dense.md). Per kernel
name: launches and GPU microseconds a step, share of the step without PDL, and where the bytes
it reads are known (the quantized matmuls read their type's weights once a step, flash-decoding's
split kernels the KV cache) the bandwidth it reached against the device's measured copy
bandwidth (a 1 GiB device-to-device copy: read + write bytes over time); for the whole step, the
bytes over the shipped step time. The weight bytes are the GGUF's (token embeddings excluded: one
row a step); the engine's repacked layouts differ by their few header bytes. Not a test; results
in tests/perf/results/server.md (tests/perf/gpu_serve2.sh runs it). On a CPU (`--device cpu`: a
dry run of the script) the captured function runs eagerly under the CPU profiler. `--lora`
(repeatable) puts the step's row on those adapters at scale 1, as `localllm bench --lora` does:
the LoRA kernels' share of the step, and what they add to the base kernels, by name.
"""

import argparse
import sys
from collections import defaultdict

import gguf
import torch
from torch.profiler import ProfilerActivity, profile

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.cuda_graphs import COLS, DecodeGraphs, pack_decode
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states

try:
    from localllm.kernels import pdl
except ImportError:  # no triton (a CPU dry run): nothing launches with PDL
    pdl = None

BS = 16
CHUNK = 2048  # prefill tokens per forward
# kernel-name parts -> what the kernel reads once a step ("kv": the cache; else a ggml type)
# (flash-decoding's split kernels, kernels/attention/triton_decode.py, read the cache; their
# combine reads only the splits' partial results)
READS = (("q4k", "Q4_K"), ("q4_k", "Q4_K"), ("q6k", "Q6_K"), ("q6_k", "Q6_K"),
         ("q8_0", "Q8_0"), ("_split_kernel", "kv"), ("_split_dot_kernel", "kv"),
         ("attn", "kv"), ("attention", "kv"), ("flash", "kv"))  # fmt: skip


def weight_bytes(path: str) -> dict[str, int]:
    """Bytes per ggml type of the tensors a decode step reads (token embeddings excluded)."""
    out: dict[str, int] = defaultdict(int)
    for t in gguf.GGUFReader(path).tensors:
        if t.name != "token_embd.weight":
            out[t.tensor_type.name] += int(t.n_bytes)
    return dict(out)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy, read + write counted (the floor's yardstick)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    if device.type != "cuda":
        import time

        t0 = time.perf_counter()
        for _ in range(reps):
            b.copy_(a)
        return 2 * nbytes * reps / (time.perf_counter() - t0)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    e0.record()
    for _ in range(reps):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (e0.elapsed_time(e1) / 1e3)


def reads_of(name: str) -> str | None:
    low = name.lower()
    return next((what for part, what in READS if part in low), None)


def _prefill(model, kv, depth: int, vocab: int, device) -> None:
    ids = torch.randint(0, vocab, (depth,), device=device)
    for c in range(0, depth, CHUNK):
        n = min(CHUNK, depth - c)
        meta = BatchMeta.contiguous(n, c + n, BS)
        meta = BatchMeta(meta.query_start, meta.seq_lens, meta.block_tables,
                         meta.slot_mapping.to(device), BS)  # fmt: skip
        model(ids[c : c + n], torch.arange(c, c + n, device=device), meta, kv)


def _stepper(graphs, rows, cuda: bool):
    """One decode step: the graph's replay (CUDA), or its function run eagerly on the rows padded
    to the graph's width (the CPU dry run)."""
    if cuda:
        return lambda: graphs.run(rows)
    key = graphs.key(1, rows.shape[1] - COLS)
    padded = torch.cat([rows, rows.new_zeros(1, key[1] + COLS - rows.shape[1])], 1)
    return lambda: graphs.forward(padded)


def _timed_us(step, device, n: int = 50) -> float:
    """Microseconds a step, CUDA events over n replays after 3 warm ones (capture included)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        step()
    e1.record()
    torch.cuda.synchronize(device)
    return 1e3 * e0.elapsed_time(e1) / n


def one_depth(model, path_bytes, depth, device, steps, bw) -> list[str]:
    layers, kvh, hd = model.kv_shape()
    blocks = depth // BS + 2
    kv = PagedKVCache(layers, blocks, BS, kvh, hd, "f16", device, model.kv_value_dim())
    attach_states(kv, model, 1)  # hybrid models: the one sequence's recurrent state, slot 0
    table = list(range(blocks))
    cuda = device.type == "cuda"
    with torch.inference_mode():
        _prefill(model, kv, depth, model.args.vocab_size, device)
        rows = pack_decode([1], [depth], [depth], [table]).to(device)
        shipped = DecodeGraphs(model, kv)  # as `serve` and `bench` capture it (PDL on sm_90+)
        step_us = split_us = None
        if cuda:
            step_us = _timed_us(_stepper(shipped, rows, cuda), device)
            assert shipped.graphs, f"decode graph not captured: {shipped.failed}"
        # profiled: a capture without PDL (under PDL a kernel's time includes its wait for the
        # one before, and the kernels' times add up to several steps)
        if pdl is not None:
            saved, pdl.enabled = pdl.enabled, lambda t: False
        try:
            split = DecodeGraphs(model, kv)
            step = _stepper(split, rows, cuda)
            if cuda:
                split_us = _timed_us(step, device)
            else:
                step()
            acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    step()
                if cuda:
                    torch.cuda.synchronize(device)
        finally:
            if pdl is not None:
                pdl.enabled = saved
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total" if cuda else "self_cpu_time_total", 0)
        if t > 0:
            per[evt.key[:70]][0] += t / steps
            per[evt.key[:70]][1] += evt.count / steps
    busy = sum(v[0] for v in per.values())
    if not cuda:
        step_us = split_us = busy  # (the CPU dry run: its ops' own time)
    kv_bytes = 2 * layers * kvh * hd * 2 * depth  # K and V, f16, every cached token
    need = {**path_bytes, "kv": kv_bytes}
    total = sum(path_bytes.values()) + kv_bytes
    gbs = total / step_us / 1e3  # bytes per microsecond / 1e3: GB/s
    out = [
        f"depth {depth}: step {step_us:.1f} us ({1e6 / step_us:.1f} t/s) as shipped; captured "
        f"without PDL {split_us:.1f} us, its kernels {busy:.1f} us busy, {split_us - busy:.1f} "
        f"us between them, {sum(v[1] for v in per.values()):.0f} launches a step (the table)",
        f"bytes a step {total / 1e6:.1f} MB (weights {sum(path_bytes.values()) / 1e6:.1f}, KV "
        f"{kv_bytes / 1e6:.1f}): {gbs:.0f} GB/s, {100 * gbs / (bw / 1e9):.1f} % of the copy "
        f"bandwidth {bw / 1e9:.0f} GB/s",
        "",
        "| kernel | launches/step | us/step | share of step % | reads | MB/step | GB/s "
        "| % of copy bw |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]  # fmt: skip
    for name, (us, n) in sorted(per.items(), key=lambda kv_: -kv_[1][0]):
        what = reads_of(name)
        nb = need.get(what) if what else None
        cells = ["-", "-", "-"]
        if nb:
            gbs = nb / us / 1e3
            cells = [f"{nb / 1e6:.1f}", f"{gbs:.0f}", f"{100 * gbs / (bw / 1e9):.1f}"]
        out.append(f"| {name} | {n:.0f} | {us:.1f} | {100 * us / split_us:.1f} | {what or '-'} | "
                   + " | ".join(cells) + " |")  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--depth", default="512", help="context depths, comma-separated (512)")
    ap.add_argument("--steps", type=int, default=20, help="profiled replays per depth (20)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lora", action="append", default=[], help="adapter on every step (PATH)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    path_bytes = weight_bytes(a.model)
    gg = open_gguf(a.model)
    try:
        model = build_model(gg, device=device)
        if a.lora:  # the row on every adapter at scale 1: their decode overhead
            from localllm.engine.lora import LoraSpec, attach_adapters

            loras = attach_adapters(model, [LoraSpec(p) for p in a.lora], gg, device)
            loras.context.apply_all(loras.resolve(None))
            print(f"# LoRA: {', '.join(a.lora)} on the step's row")
        bw = copy_bandwidth(device)
        print(f"# {a.model}: weights read a step by type (MB) "
              + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(path_bytes.items()))
              + f"; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")  # fmt: skip
        for d in (int(x) for x in a.depth.split(",") if x):
            print("\n".join(one_depth(model, path_bytes, d, device, a.steps, bw)) + "\n")
    finally:
        gg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
