"""Rotary position embeddings: the two pair layouts GGUF models use, plus frequency scaling.

llama.cpp's NORM mode rotates adjacent pairs (x0, x1), which is what llama-arch GGUF files expect
(the converter permutes Q/K for it); NEOX mode rotates the two halves (x_i, x_{i+d/2}).
"""

import math
from dataclasses import dataclass

import torch

from localllm.kernels.fused.heads import HeadLayout


@dataclass(frozen=True, slots=True)
class RopeConfig:
    dims: int  # how many leading head dims rotate (partial rotary when < head_dim)
    base: float = 10000.0
    neox: bool = False  # True: rotate halves; False: rotate adjacent pairs
    linear_scale: float = 1.0  # positions are divided by this ("linear" rope scaling)
    attn_factor: float = 1.0  # cos/sin magnitude (LongRoPE/YaRN attention factor, llama.cpp mscale)
    yarn_factor: float = 1.0  # YaRN context extension factor (1.0: no YaRN)
    yarn_orig_ctx: int = 0  # the context the model was trained at (YaRN's correction range)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True  # llama.cpp floors/ceils the correction range; gpt-oss does not


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
        if cfg.yarn_factor != 1.0:
            inv_freq = _yarn(inv_freq, cfg)
        self.inv_freq = (inv_freq / cfg.linear_scale).to(torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, dims/2]
        if self.cfg.attn_factor != 1.0:
            return angles.cos() * self.cfg.attn_factor, angles.sin() * self.cfg.attn_factor
        return angles.cos(), angles.sin()

    def layout(self, n_q: int, n_kv: int, head_dim: int) -> HeadLayout:
        """The head layout the fused rope kernel needs for a layer with these heads."""
        return HeadLayout(n_q, n_kv, head_dim, self.cfg.dims, self.cfg.neox)

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


def _yarn(inv_freq: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """YaRN's blend: high frequencies keep their angle, low ones are divided by the factor, with a
    linear ramp between the dims that turn beta_fast and beta_slow times over the original context
    (llama.cpp's ggml_rope_yarn_corr_dims, transformers' _compute_yarn_parameters)."""

    def corr_dim(rotations: float) -> float:
        return (
            cfg.dims
            * math.log(cfg.yarn_orig_ctx / (rotations * 2 * math.pi))
            / (2 * math.log(cfg.base))
        )

    low, high = corr_dim(cfg.yarn_beta_fast), corr_dim(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, cfg.dims - 1)
    i = torch.arange(cfg.dims // 2, dtype=torch.float64)
    ramp = ((i - low) / max(high - low, 0.001)).clamp(0, 1)  # 0: extrapolate, 1: interpolate
    return inv_freq * (1 - ramp) + inv_freq / cfg.yarn_factor * ramp


def yarn_mscale(factor: float, mul: float = 0.1) -> float:
    """YaRN's attention magnitude correction 1 + mul * ln(factor) (1.0 when not extending)."""
    return 1.0 + mul * math.log(factor) if factor > 1.0 else 1.0


class MRotary(Rotary):
    """M-RoPE (Qwen2-VL, llama.cpp's rope `sections`): the frequencies are split between three
    position axes (temporal, height, width). `sections` counts frequencies per axis, in blocks
    (Qwen2-VL) or `interleaved` t,h,w,t,h,w... (Qwen3-VL); a frequency past them turns with the
    temporal axis. Positions [3, T] turn each frequency by its axis; positions [T] (text, where
    the axes agree) are plain rope."""

    def __init__(self, cfg: RopeConfig, sections, interleaved: bool = False, freq_factors=None):
        super().__init__(cfg, freq_factors)
        n = cfg.dims // 2
        s = [int(x) for x in sections][:3] + [0] * (3 - len(sections[:3]))
        if interleaved:
            axis = [j % 3 if j % 3 and j < 3 * s[j % 3] else 0 for j in range(n)]
        else:
            bounds = [s[0], s[0] + s[1], s[0] + s[1] + s[2]]
            axis = [next((a for a, b in enumerate(bounds) if j < b), 0) for j in range(n)]
        self.sections = tuple(s)
        self.axis = torch.tensor(axis, dtype=torch.long)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        if self.axis.device != positions.device:  # moved once, with the model
            self.axis = self.axis.to(positions.device)
        pos = positions.to(torch.float32)[self.axis].T  # [T, dims/2]: each frequency's own axis
        angles = pos * self.inv_freq[None, :]
        if self.cfg.attn_factor != 1.0:
            return angles.cos() * self.cfg.attn_factor, angles.sin() * self.cfg.attn_factor
        return angles.cos(), angles.sin()
