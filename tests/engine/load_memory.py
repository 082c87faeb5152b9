"""The device memory a GPU load takes (shared by the GPU tests that bound it): a model built on
CUDA from a GGUF, with the file's bytes, what the load keeps and its peak, both counted from
before the load."""

import torch

from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.residency import load_model, plan_model
from localllm.offload.memory import probe_memory
from localllm.offload.residency import resolve


def measured_load(path, load_mode: str = "mmap") -> tuple[torch.nn.Module, int, int, int]:
    """(model, file bytes, bytes kept after the load, peak bytes during it); `read`: loaded
    from private read copies under a plan, as `--load-mode read` does."""
    g = open_gguf(path)
    try:
        file_bytes = sum(t.range.nbytes for t in g.tensors.values())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if load_mode == "read":
            cfg = resolve([("test", {"load_mode": "read"})])
            model = load_model(g, plan_model(g, cfg, memory=probe_memory("cuda")), device="cuda")
        else:
            model = build_model(g, device="cuda")
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        g.close()
    return model, file_bytes, kept, peak
