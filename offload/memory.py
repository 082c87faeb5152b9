"""Memory probing: how many bytes a new allocation may take on a device right now.

The page cache is not counted as ours: `available` from psutil already treats reclaimable cache
as free, and we never add cached file pages on top. On unified memory (integrated GPUs, Apple)
device and host draw from one pool, so it is reported once.
"""

from dataclasses import dataclass

import psutil
import torch


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Free memory on `device`: host RAM the OS can give without swapping, or free device memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Free memory for a plan. `device_free` is None when compute runs on the CPU (no separate
    device pool) or when the device shares host memory (`unified`)."""

    device: str
    host_free: int
    device_free: int | None = None
    unified: bool = False

    @property
    def separate_device(self) -> bool:
        return self.device_free is not None


def is_unified(device: torch.device) -> bool:
    """True when `device` computes out of host RAM (Apple MPS, integrated CUDA GPUs like GB10)."""
    if device.type == "mps":
        return True
    if device.type == "cuda":
        return bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
    return False


def probe_memory(device: torch.device | str = "cpu") -> MemoryInfo:
    """Measure free memory for `device` (host RAM always; device memory when it is separate)."""
    device = torch.device(device)
    host = available_bytes("cpu")
    if device.type == "cpu" or is_unified(device):
        return MemoryInfo(str(device), host, None, unified=device.type != "cpu")
    return MemoryInfo(str(device), host, available_bytes(device))
