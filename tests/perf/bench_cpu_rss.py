"""Resident memory a CPU model adds: RSS growth of one process from before `build_model` to
after a 16-token prompt and 16 decode steps (f16 KV of 40 blocks), against the file's size
plus the KV cache (issue 39's goal: at most 10 % above). The kernel libraries and torch's
allocators are warmed before the baseline. Not a test: its line goes into
tests/perf/results/cpu.md.

    python tests/perf/bench_cpu_rss.py MODEL.gguf
    PYTHONPATH=/path/to/older/tree python tests/perf/bench_cpu_rss.py MODEL.gguf  # (an older tree)
"""

import os
import sys

import psutil
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.loader import build_model, open_weights
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.cpu import native


def main() -> None:
    torch.set_num_threads(1)
    proc = psutil.Process()
    native.load()
    try:
        from localllm.kernels.cpu import decode_step

        decode_step.load()
    except ImportError:  # an older tree
        pass
    with torch.inference_mode():
        torch.randn(512, 2048) @ torch.randn(2048, 576)  # torch's allocators, warmed
    base = proc.memory_info().rss
    model = build_model(open_weights(sys.argv[1]))
    loaded = proc.memory_info().rss - base
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, 40, 16, kvh, hd, "f16", "cpu")
    with torch.inference_mode():
        model(torch.arange(16), torch.arange(16), BatchMeta.contiguous(16, 16, 16), kv)
        tok = torch.tensor([5])
        for i in range(16):
            b = BatchMeta((0, 1), (17 + i,), (tuple(range(40)),), torch.tensor([16 + i]), 16)
            tok = model.logits(model(tok, torch.tensor([16 + i]), b, kv)).argmax(-1)
    rss = proc.memory_info().rss - base
    size = os.path.getsize(sys.argv[1])
    print(f"{os.path.basename(sys.argv[1])}: after load {loaded / 2**20:.1f} MiB, after 16 + 16 "
          f"tokens {rss / 2**20:.1f} MiB, file {size / 2**20:.1f} MiB, KV {kv.nbytes / 2**20:.1f} "
          f"MiB, ratio to file + KV {rss / (size + kv.nbytes):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
