"""Memory figures for the resource panel and the fit verdicts: RAM (psutil), this process, and
GPU memory through torch when a CUDA device is present (torch is only asked if already loaded)."""

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
