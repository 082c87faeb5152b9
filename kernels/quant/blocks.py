"""Byte-level helpers shared by the dequant references: split rows into blocks, read fields.

ggml blocks are packed little-endian structs with no alignment, so fields are read by copying the
byte columns out (a strided uint8 slice cannot be viewed as a wider dtype in place).
"""

import torch


def to_blocks(data: torch.Tensor, nbytes: int) -> torch.Tensor:
    """[..., row_bytes] uint8 -> [n_blocks, nbytes]."""
    if data.dtype != torch.uint8:
        raise TypeError(f"quantized data must be uint8, got {data.dtype}")
    if data.shape[-1] % nbytes:
        raise ValueError(f"last dim {data.shape[-1]} is not a whole number of {nbytes}-byte blocks")
    return data.reshape(-1, nbytes)


def f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of each block, as float32 [n, 1] (exact widening)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def u16(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` little-endian uint16 fields from byte `start`, as int32 [n, count]."""
    b = blocks[:, start : start + 2 * count].reshape(-1, count, 2).to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8)


def u32(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` little-endian uint32 fields from byte `start`, as int64 [n, count] (sign-safe)."""
    b = blocks[:, start : start + 4 * count].reshape(-1, count, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def i8(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` signed bytes from byte `start`, as int8 [n, count]."""
    return blocks[:, start : start + count].contiguous().view(torch.int8)


def split_bits(x: torch.Tensor, shifts: tuple[int, ...], mask: int, dim: int) -> torch.Tensor:
    """Stack (x >> s) & mask for each shift along a new axis `dim` (ggml's bit-plane layouts)."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=dim)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, L] bytes -> [n, 2L]: all low nibbles, then all high nibbles (the Q4_0-family order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A small float32 lookup table on `device`."""
    return torch.tensor(values, dtype=torch.float32, device=device)
