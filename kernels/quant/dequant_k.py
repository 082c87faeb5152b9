"""Dequant references for the K-quants (256-element super-blocks): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Same float32 operation order as gguf-py's numpy code, so results match it bit for bit.
`k_scales`, `q4_k_codes` and `q5_k_codes` are public: the int4pack repack (affine.py) uses them.
"""

import torch

from localllm.kernels.quant.blocks import f16, i8, split_bits


def q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    dl = (f16(b, 80) * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = split_bits(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, sc = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    # 16 six-bit scales: low nibbles in bytes 0-7, high 2-bit pairs in bytes 8-11
    lo = split_bits(sc[:, 0:8], (0, 4), 0x0F, dim=1).reshape(n, 16)
    hi = split_bits(sc[:, 8:12], (0, 2, 4, 6), 0x03, dim=1).reshape(n, 16)
    scales = (lo | (hi << 4)).to(torch.int8) - 32
    dl = (f16(b, 108) * scales.float()).reshape(n, 16, 1)
    ql = split_bits(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=2).reshape(n, 16, 16)
    qh = split_bits(hmask.reshape(n, 1, 32), tuple(range(8)), 1, dim=2).reshape(n, 16, 16)
    # a set hmask bit means "no -4 offset"
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)
    return (dl * q.float()).reshape(n, 256)


def k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field: 8 six-bit scales, 8 six-bit mins (uint8 [n, 8])."""
    n = sc.shape[0]
    s = sc.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, mins


def k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K per-32 factors d*scale and dmin*min, float32 [n, 8, 1] each."""
    n = b.shape[0]
    sc, mn = k_scale_min(b[:, 4:16])
    d = (f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (f16(b, 2) * mn.float()).reshape(n, 8, 1)
    return d, dm


def q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = k_scales(b)
    return (d * q4_k_codes(b).float() - dm).reshape(b.shape[0], 256)


def q4_k_codes(b: torch.Tensor) -> torch.Tensor:
    """The 256 unsigned 4-bit codes of Q4_K blocks, uint8 [n, 8, 32] (per 32-value sub-block)."""
    n = b.shape[0]
    return split_bits(b[:, 16:144].reshape(n, 4, 32), (0, 4), 0x0F, dim=2).reshape(n, 8, 32)


def q5_k_codes(b: torch.Tensor) -> torch.Tensor:
    """The 256 unsigned 5-bit codes of Q5_K blocks, uint8 [n, 8, 32]."""
    n = b.shape[0]
    ql = split_bits(b[:, 48:176].reshape(n, 4, 32), (0, 4), 0x0F, dim=2).reshape(n, 8, 32)
    qh = split_bits(b[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 1, dim=2).reshape(n, 8, 32)
    return ql | (qh << 4)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = k_scales(b)
    return (d * q5_k_codes(b).float() - dm).reshape(b.shape[0], 256)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    d = (f16(b, 208) * i8(b, 192, 16).float()).reshape(n, 16, 1)
    lo = split_bits(ql.reshape(n, 2, 64), (0, 4), 0x0F, dim=2).reshape(n, 8, 32)
    hi = split_bits(qh.reshape(n, 2, 32), (0, 2, 4, 6), 0x03, dim=2).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)
