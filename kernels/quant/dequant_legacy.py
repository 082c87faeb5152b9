"""Dequant references for the 32-element block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4,
and NVFP4 (64-element blocks, FP4 with 16-element E4M3 scales).

Each function maps uint8 blocks [n, bytes] to float32 [n, elements] with the same float32 operation
order as gguf-py's numpy code, so results match it bit for bit.
"""

import functools

import torch

from localllm.kernels.quant.blocks import f16, i8, nibbles, split_bits, u32

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# E2M1 values doubled; the e8m0 / ue4m3 scale decoders below carry the matching factor 1/2.
FP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@functools.cache
def _lut(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def kvalues_lut(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A cached float32 lookup table of `values` on `device` (built on first use per device)."""
    return _lut(values, torch.device(device))


def q4_0(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:18]).to(torch.int8) - 8
    return f16(b, 0) * q.float()


def q4_1(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 4:20]).float()
    return f16(b, 0) * q + f16(b, 2)


def five_bit_codes(b: torch.Tensor, qh_at: int, qs_at: int) -> torch.Tensor:
    """The 32 unsigned 5-bit codes of Q5_0/Q5_1 blocks, int64 [n, 32]."""
    # bit i of the 32-bit qh word is the fifth bit of element i
    qh = (u32(b, qh_at, 1) >> torch.arange(32, device=b.device)) & 1
    return nibbles(b[:, qs_at : qs_at + 16]).to(torch.int64) | (qh << 4)


def q5_0(b: torch.Tensor) -> torch.Tensor:
    q = five_bit_codes(b, 2, 6) - 16
    return f16(b, 0) * q.float()


def q5_1(b: torch.Tensor) -> torch.Tensor:
    q = five_bit_codes(b, 4, 8).float()
    return f16(b, 0) * q + f16(b, 2)


def q8_0(b: torch.Tensor) -> torch.Tensor:
    return i8(b, 2, 32).float() * f16(b, 0)


def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = nibbles(b[:, 2:18]).long()
    return f16(b, 0) * kvalues_lut(IQ4_NL_VALUES, b.device)[q]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e-128) built from its bit pattern (denormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(b[:, 0:1])
    q = kvalues_lut(FP4_VALUES, b.device)[nibbles(b[:, 1:17]).long()]
    return d * q


@functools.cache
def _ue4m3_lut(device: torch.device) -> torch.Tensor:
    # All 256 byte values decoded in float64: every value is exact in float32, so order is moot.
    x = torch.arange(256, dtype=torch.int64)
    exp = (x >> 3) & 0xF
    man = (x & 0x7).double()
    raw = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * torch.pow(2.0, exp - 7.0))
    raw = torch.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)
    return raw.float().to(device)


def nvfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _ue4m3_lut(torch.device(b.device))[b[:, 0:4].long()].reshape(n, 4, 1)
    qs = b[:, 4:36].reshape(n, 4, 8)
    q = split_bits(qs, (0, 4), 0x0F, dim=2).reshape(n, 4, 16)
    return (d * kvalues_lut(FP4_VALUES, b.device)[q.long()]).reshape(n, 64)
