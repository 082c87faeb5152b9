"""Rotary position embeddings: the two pair layouts GGUF models use, plus frequency scaling.

llama.cpp's NORM mode rotates adjacent pairs (x0, x1), which is what llama-arch GGUF files expect
(the converter permutes Q/K for it); NEOX mode rotates the two halves (x_i, x_{i+d/2}).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeConfig:
    dims: int  # how many leading head dims rotate (partial rotary when < head_dim)
    base: float = 10000.0
    neox: bool = False  # True: rotate halves; False: rotate adjacent pairs
    linear_scale: float = 1.0  # positions are divided by this ("linear" rope scaling)
    attn_factor: float = 1.0  # cos/sin magnitude (LongRoPE/YaRN attention factor, llama.cpp mscale)


class Rotary:
    """Precomputed inverse frequencies; applies rotation for arbitrary positions."""

    def __init__(self, cfg: RopeConfig, freq_factors: torch.Tensor | None = None):
        self.cfg = cfg
        exponent = torch.arange(0, cfg.dims, 2, dtype=torch.float64) / cfg.dims
        inv_freq = 1.0 / (cfg.base**exponent)
        if freq_factors is not None:
            # llama3-style scaling (rope_freqs) and LongRoPE (rope_factors_*) ship per-frequency
            # divisors of the angle.
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        self.inv_freq = (inv_freq / cfg.linear_scale).to(torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, dims/2]
        if self.cfg.attn_factor != 1.0:
            return angles.cos() * self.cfg.attn_factor, angles.sin() * self.cfg.attn_factor
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] with cos/sin [T, dims/2]."""
        d = self.cfg.dims
        if not self.cfg.neox and d == x.shape[-1] and x.dtype == torch.float32:
            # Adjacent pairs are complex numbers: one complex multiply instead of ~12 eager ops
            # (decode on CPU is dominated by per-op overhead).
            xc = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2))
            return torch.view_as_real(xc * torch.complex(cos, sin)[:, None, :]).flatten(-2)
        rot, rest = x[..., :d], x[..., d:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.cfg.neox:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
