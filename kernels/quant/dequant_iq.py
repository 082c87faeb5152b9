"""Dequant references for the codebook ("IQ") types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ1_S, IQ1_M, and IQ4_XS (non-linear 4-bit with K-style sub-block scales).

Same float32 operation order as gguf-py's numpy code, so results match it bit for bit.
"""

import torch

from localllm.kernels.quant.blocks import f16, split_bits, u16, u32
from localllm.kernels.quant.dequant_legacy import IQ4_NL_VALUES, kvalues_lut
from localllm.kernels.quant.iq_grids import grid, ksign_table, sign_bits


def _half_scale(d: torch.Tensor, s: torch.Tensor, factor: float) -> torch.Tensor:
    # d * (0.5 + s) * factor, in that order (gguf-py's)
    return d * (0.5 + s.float()) * factor


def _nibble_scales(sc: torch.Tensor) -> torch.Tensor:
    return split_bits(sc, (0, 4), 0x0F, dim=-1).reshape(sc.shape[0], -1)


def iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = b[:, 2:66].reshape(n, 8, 8)
    aux = u32(b, 2, 16).reshape(n, 8, 2)[..., 1]  # per 32 values: 4 x 7-bit signs, 4-bit scale
    db = _half_scale(f16(b, 0), aux >> 28, 0.25).reshape(n, 8, 1, 1)
    signs = ksign_table(b.device)[split_bits(aux, (0, 7, 14, 21), 0x7F, dim=-1)]
    g = grid("IQ2_XXS", b.device)[qs[:, :, 0:4].long()]
    return (db * g * signs).reshape(n, 256)


def iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = u16(b, 2, 32)  # 9-bit grid index, 7-bit sign index
    db = _half_scale(f16(b, 0), _nibble_scales(b[:, 66:74]), 0.25).reshape(n, 16, 1, 1)
    signs = ksign_table(b.device)[(qs >> 9).long()].reshape(n, 16, 2, 8)
    g = grid("IQ2_XS", b.device)[(qs & 511).long()].reshape(n, 16, 2, 8)
    return (db * g * signs).reshape(n, 256)


def iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    db = _half_scale(f16(b, 0), _nibble_scales(b[:, 74:82]), 0.25).reshape(n, 16, 1, 1)
    signs = sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)
    qh = split_bits(b[:, 66:74], (0, 2, 4, 6), 0x03, dim=-1).reshape(n, 32)
    idx = b[:, 2:34].long() | (qh.long() << 8)
    g = grid("IQ2_S", b.device)[idx].reshape(n, 16, 2, 8)
    return (db * g * signs).reshape(n, 256)


def iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    aux = u32(b, 66, 8)
    db = _half_scale(f16(b, 0), aux >> 28, 0.5).reshape(n, 8, 1, 1)
    signs = ksign_table(b.device)[split_bits(aux, (0, 7, 14, 21), 0x7F, dim=-1)]
    g = grid("IQ3_XXS", b.device)[b[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * g * signs).reshape(n, 256)


def iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = _nibble_scales(b[:, 106:110])
    db = (f16(b, 0) * (1 + 2 * sc).float()).reshape(n, 8, 1, 1)
    signs = sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
    qh = split_bits(b[:, 66:74], tuple(range(8)), 1, dim=-1).reshape(n, 64)
    idx = b[:, 2:66].long() | (qh.long() << 8)
    g = grid("IQ3_S", b.device)[idx].reshape(n, 8, 4, 8)
    return (db * g * signs).reshape(n, 256)


def _delta(negative: torch.Tensor) -> torch.Tensor:
    return torch.where(negative, -0.125, 0.125)


def iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = u16(b, 34, 8)
    dl = (f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = _delta((qh & 0x8000) != 0).reshape(n, 8, 1, 1)
    idx = b[:, 2:34].long() | (split_bits(qh, (0, 3, 6, 9), 7, dim=-1).reshape(n, 32).long() << 8)
    g = grid("IQ1_S", b.device)[idx].reshape(n, 8, 4, 8)
    return (dl * (g + delta)).reshape(n, 256)


def iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = u16(b, 48, 4)
    # the fp16 super-scale is scattered over the top nibbles of the four scale words
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00)
    d_bits = d_bits | (sc[:, 3] & 0xF000)
    d = d_bits.to(torch.int16).view(torch.float16).float().reshape(n, 1)
    s = split_bits(sc, (0, 3, 6, 9), 7, dim=-1).reshape(n, 16)
    dl = (d * (2 * s + 1).float()).reshape(n, 8, 2, 1, 1)
    qh = split_bits(b[:, 32:48], (0, 4), 0x0F, dim=-1)  # [n, 16, 2]
    idx = b[:, 0:32].long() | ((qh & 7).reshape(n, 32).long() << 8)
    delta = _delta((qh & 8) != 0).reshape(n, 8, 2, 2, 1)
    g = grid("IQ1_S", b.device)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (g + delta)).reshape(n, 256)


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sh = u16(b, 2, 1)
    lo = _nibble_scales(b[:, 4:8])
    hi = split_bits(sh, tuple(range(0, 16, 2)), 3, dim=-1).reshape(n, 8)
    scales = (lo.to(torch.int32) | (hi << 4)) - 32
    dl = (f16(b, 0) * scales.float()).reshape(n, 8, 1)
    q = split_bits(b[:, 8:136].reshape(n, 8, 16), (0, 4), 0x0F, dim=2).reshape(n, 8, 32)
    return (dl * kvalues_lut(IQ4_NL_VALUES, b.device)[q.long()]).reshape(n, 256)
