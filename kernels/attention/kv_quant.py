"""KV-cache storage formats: float (f32/f16/bf16) and two 8-bit encodings with their scales.

- ``q8_0``: int8 values with one fp16 scale per group of 32 values of a head vector (ggml's Q8_0
  rule: d = amax / 127, q = round(x / d)); a head dim not divisible by 32 uses one group.
- ``fp8``: float8 e4m3 values with one float32 scale per (token, head) vector (amax -> 448).

Both cost ~1.06 bytes per value at head dim 64 (2 bytes of scale per 32 values, or 4 per vector).
A stored vector is a pair (values, scales); scales is None for the float formats.
"""

import torch

KV_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "q8_0": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
Q8_GROUP = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn
F16_MAX = 65504.0


def q8_group(head_dim: int) -> int:
    """Values per q8_0 scale: 32, or the whole vector when 32 does not divide it."""
    return Q8_GROUP if head_dim % Q8_GROUP == 0 else head_dim


def scale_shape(dtype: str, head_dim: int) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Trailing shape and dtype of the scales stored per (token, head), or None (float formats)."""
    if dtype == "q8_0":
        return (head_dim // q8_group(head_dim),), torch.float16
    if dtype == "fp8":
        return (), torch.float32
    if dtype in KV_DTYPES:
        return None
    raise ValueError(f"unknown KV dtype {dtype!r}: expected one of {sorted(KV_DTYPES)}")


def vector_nbytes(dtype: str, head_dim: int) -> int:
    """Bytes one stored head vector of `head_dim` values takes, scales included."""
    sc = scale_shape(dtype, head_dim)  # validates the name first
    n = head_dim * KV_DTYPES[dtype].itemsize
    if sc is not None:
        shape, sdt = sc
        n += (shape[0] if shape else 1) * sdt.itemsize
    return n


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (int8 [..., D], fp16 scales [..., D / group])."""
    d = x.shape[-1]
    g = q8_group(d)
    xg = x.float().reshape(*x.shape[:-1], d // g, g)
    scale = (xg.abs().amax(-1) / 127.0).clamp(max=F16_MAX).half()
    # Divide by the fp16-rounded scale that dequantization will use (not the exact amax / 127).
    sf = scale.float()
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    q = (xg * inv.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_q8_0(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_q8_0`: int8 [..., D] and fp16 [..., D / group] -> [..., D] `dtype`."""
    groups = scale.shape[-1]
    qg = q.reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    return (qg.to(dtype) * scale.to(dtype).unsqueeze(-1)).reshape(q.shape)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (float8_e4m3fn [..., D], float32 scales [...]): amax maps to 448."""
    xf = x.float()
    scale = xf.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (xf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8`: float8 [..., D] and float32 [...] -> [..., D] `dtype`."""
    return q.to(dtype) * scale.to(dtype).unsqueeze(-1)


def encode_kv(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head vectors [..., D] in a storage format: (values, scales or None)."""
    if dtype == "q8_0":
        return quantize_q8_0(x)
    if dtype == "fp8":
        return quantize_fp8(x)
    return x.to(KV_DTYPES[dtype]), None


def decode_kv(
    values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Stored vectors back to float `dtype`; the storage format is told by the values' dtype."""
    if values.dtype == torch.int8:
        return dequantize_q8_0(values, scales, dtype)
    if values.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(values, scales, dtype)
    return values.to(dtype)
