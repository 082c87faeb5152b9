"""CPU decode per token: time and torch op count of three variants in one process, alternating:
`step` (the default: llama layers in one native call, `engine/layers/native_decode.py`),
`linears` (the native block linears under the torch layers: exact float32 tiles for the types
new to them, int8 rows for Q4_K/Q6_K/Q8_0) and `before` (no block kernels: int4pack / fp16
copies for every type, what a machine without a C compiler runs).

Not a test: a script whose output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md. Each variant loads the model once; rounds alternate the variants so
a shared box's load falls on both alike.

    python tests/perf/bench_cpu_decode.py --model FILE [--threads 2] [--rounds 3] [--steps 32]
        [--profile]
"""

import argparse
import dataclasses
import os
import statistics
import time

import torch

from localllm.engine import loader
from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.cpu import native as native_mod

VARIANTS = ("step", "linears", "before")


def build(path: str, variant: str):
    """The model of one variant (see the module's docstring)."""
    real = native_mod.load

    def load(cache_dir=None):
        k = real(cache_dir)
        return k if k is None or variant != "before" else dataclasses.replace(k, blocks=None)

    loader.load_native = load
    try:
        gguf = loader.open_weights(path)
        model = loader.build_model(gguf)
        if variant != "step":
            model._native_step = False  # the torch layers
    finally:
        loader.load_native = real
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, 64, 16, kvh, hd, "f16", "cpu")
    return gguf, model, kv


def forward(model, kv, ids, start):
    n = ids.shape[0]
    batch = BatchMeta.contiguous(n, start + n, 16)
    return model.logits(model(ids, torch.arange(start, start + n), batch, kv)[-1:])


def decode_ms(model, kv, steps: int) -> float:
    """ms per decode step after a 16-token prompt (argmax fed back)."""
    with torch.inference_mode():
        forward(model, kv, torch.arange(16), 0)
        tok = torch.tensor([5])
        t0 = time.perf_counter()
        for i in range(steps):
            tok = forward(model, kv, tok, 16 + i).argmax(-1)
        return (time.perf_counter() - t0) / steps * 1e3


def profile(model, kv, steps: int = 4) -> tuple[float, list]:
    """(aten ops per token, the top rows by self time) over `steps` decode steps."""
    with torch.inference_mode():
        forward(model, kv, torch.arange(16), 0)
        tok = torch.tensor([5])
        with torch.profiler.profile() as p:
            for i in range(steps):
                tok = forward(model, kv, tok, 16 + i).argmax(-1)
    ev = p.key_averages()
    ops = sum(e.count for e in ev if e.key.startswith("aten::"))
    top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:8]
    return ops / steps, [(e.key, e.count // steps, e.self_cpu_time_total / steps) for e in top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="op counts and top ops per variant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    models = {v: build(args.model, v) for v in VARIANTS}
    for v, (_, m, _) in models.items():
        kinds = {}
        for mod in m.modules():
            for k in getattr(mod, "kernels", lambda: [])():
                kinds[k.kind] = kinds.get(k.kind, 0) + k.nbytes
        print(v, "prepared MiB by kind:", {k: round(b / 2**20, 1) for k, b in kinds.items()})
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            _, m, kv = models[v]
            times[v].append(decode_ms(m, kv, args.steps))
    for v in VARIANTS:
        ms = times[v]
        each = ", ".join(f"{x:.2f}" for x in ms)
        print(f"{v}: {statistics.median(ms):.2f} ms/token (rounds {each})")
    if args.profile:
        for v in VARIANTS:
            _, m, kv = models[v]
            ops, top = profile(m, kv)
            print(f"{v}: {ops:.0f} aten ops per token; top self time (us per token):")
            for key, n, us in top:
                print(f"   {key:40s} {n:5d} calls {us:9.1f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
