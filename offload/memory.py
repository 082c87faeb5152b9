"""Memory probing: how many bytes a new allocation may take on a device right now."""

import psutil
import torch


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Free memory on `device`: host RAM the OS can give without swapping, or free device memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)
