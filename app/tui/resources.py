"""Memory figures for the resource panel and the fit verdicts: RAM (psutil), this process, and
GPU memory through torch when a CUDA device is present (torch is only asked if already loaded);
the expert cache's hit rate and read speed when the loaded model streams MoE experts."""

import sys
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Memory:
    ram_total: int
    ram_available: int
    process_rss: int
    gpu_name: str | None = None
    gpu_total: int | None = None
    gpu_free: int | None = None


def probe_memory() -> Memory:
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    name = total = free = None
    torch = sys.modules.get("torch")  # importing torch just to look would cost seconds
    if torch is not None and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        name = torch.cuda.get_device_name()
    return Memory(vm.total, vm.available, rss, name, total, free)


def available_for_model(mem: Memory) -> int:
    """Where a model would go: the GPU when there is one, else RAM."""
    return mem.gpu_free if mem.gpu_free is not None else mem.ram_available


@dataclass(frozen=True)
class ExpertCache:
    hit_rate: float  # lookups served from a slot, since the model was loaded
    read_gbps: float  # bandwidth of the expert reads from the file


def expert_cache(backend: object) -> ExpertCache | None:
    """The loaded model's expert-cache figures when it streams experts from disk, else None."""
    model = getattr(getattr(getattr(backend, "engine", None), "engine", None), "model", None)
    plan = getattr(model, "residency_plan", None)
    if plan is None or not plan.streams:
        return None
    stats = [s.stats for s in model.expert_sources]
    lookups, hits = sum(s.lookups for s in stats), sum(s.hits for s in stats)
    nbytes, seconds = sum(s.bytes_read for s in stats), sum(s.read_seconds for s in stats)
    rate = hits / lookups if lookups else 0.0
    return ExpertCache(rate, nbytes / seconds / 1e9 if seconds > 0 else 0.0)
