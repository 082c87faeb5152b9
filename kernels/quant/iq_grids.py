"""The IQ codebooks as torch tensors, built from iq_grids_table.py on first use, cached per
device."""

import functools

import torch

from localllm.kernels.quant import iq_grids_table


@functools.cache
def _grid(name: str, device: torch.device) -> torch.Tensor:
    rows, cols, hex_parts = getattr(iq_grids_table, f"{name}_GRID")
    raw = bytearray(bytes.fromhex("".join(hex_parts)))
    g = torch.frombuffer(raw, dtype=torch.int8).reshape(rows, cols)
    return g.float().to(device)


def grid(name: str, device: torch.device) -> torch.Tensor:
    """float32 [rows, cols] codebook of type `name` ("IQ2_XXS", ..., "IQ1_S") on `device`."""
    return _grid(name, torch.device(device))


@functools.cache
def _ksigns(device: torch.device) -> torch.Tensor:
    raw = torch.frombuffer(
        bytearray(bytes.fromhex("".join(iq_grids_table.KSIGNS))), dtype=torch.uint8
    )
    bits = (raw.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return torch.where(bits == 0, 1.0, -1.0).to(device)


def ksign_table(device: torch.device) -> torch.Tensor:
    """float32 [128, 8] of +-1: the sign pattern for each 7-bit ksigns index."""
    return _ksigns(torch.device(device))


def sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., L] of explicit sign bits -> float32 [..., L, 8] of +-1 (bit set = negative)."""
    bits = (signs.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=signs.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0)
