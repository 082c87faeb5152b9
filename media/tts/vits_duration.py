"""VITS stochastic duration predictor, reverse (sampling) direction, in plain torch.

Noise [1, 2, T] runs backwards through Flip / ConvFlow (rational-quadratic spline couplings
conditioned on the text) / ElementwiseAffine; the first channel is log-duration. As in VITS
inference, the last ConvFlow (`flows.1`) is skipped: it only acts on the unused channel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from localllm.media.tts.onnx_weights import PiperWeights
from localllm.media.tts.vits_text import channel_layer_norm

_MIN_BIN = 1e-3
_MIN_DERIVATIVE = 1e-3
_TAIL_BOUND = 5.0


def dds_conv(
    w: PiperWeights, prefix: str, x: torch.Tensor, g: torch.Tensor | None = None
) -> torch.Tensor:
    """Dilated depth-separable conv stack with exact GELU and channel LayerNorms."""
    if g is not None:
        x = x + g
    i = 0
    while f"{prefix}.convs_sep.{i}" in w.convs:
        y = w.conv(f"{prefix}.convs_sep.{i}")(x)
        y = channel_layer_norm(
            y, w.tensor(f"{prefix}.norms_1.{i}.gamma"), w.tensor(f"{prefix}.norms_1.{i}.beta")
        )
        y = w.conv(f"{prefix}.convs_1x1.{i}")(F.gelu(y))
        y = channel_layer_norm(
            y, w.tensor(f"{prefix}.norms_2.{i}.gamma"), w.tensor(f"{prefix}.norms_2.{i}.beta")
        )
        x = x + F.gelu(y)
        i += 1
    return x


def _knots(unnormalized: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bin sizes and cumulative knot positions from unnormalized bin logits."""
    n = unnormalized.shape[-1]
    sizes = _MIN_BIN + (1 - _MIN_BIN * n) * torch.softmax(unnormalized, dim=-1)
    cum = F.pad(torch.cumsum(sizes, dim=-1), (1, 0), value=0.0)
    cum = (hi - lo) * cum + lo
    cum[..., 0] = lo
    cum[..., -1] = hi
    return cum[..., 1:] - cum[..., :-1], cum


def inverse_rq_spline(
    y: torch.Tensor, u_widths: torch.Tensor, u_heights: torch.Tensor, u_derivs: torch.Tensor
) -> torch.Tensor:
    """Inverse of the rational-quadratic spline on [-B, B] with identity (linear) tails."""
    inside = (y >= -_TAIL_BOUND) & (y <= _TAIL_BOUND)
    constant = math.log(math.exp(1 - _MIN_DERIVATIVE) - 1)
    u_derivs = F.pad(u_derivs, (1, 1), value=constant)
    widths, cumwidths = _knots(u_widths, -_TAIL_BOUND, _TAIL_BOUND)
    heights, cumheights = _knots(u_heights, -_TAIL_BOUND, _TAIL_BOUND)
    derivs = _MIN_DERIVATIVE + F.softplus(u_derivs)
    search = cumheights.clone()
    search[..., -1] += 1e-6
    idx = (torch.sum(y[..., None] >= search, dim=-1) - 1).clamp(0, widths.shape[-1] - 1)[..., None]

    def at(t: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, idx)[..., 0]

    cw, bw, ch, bh = at(cumwidths), at(widths), at(cumheights), at(heights)
    delta = at(heights / widths)
    d0, d1 = at(derivs), at(derivs[..., 1:])
    dy = y - ch
    a = dy * (d0 + d1 - 2 * delta) + bh * (delta - d0)
    b = bh * d0 - dy * (d0 + d1 - 2 * delta)
    c = -delta * dy
    root = (2 * c) / (-b - torch.sqrt(b.pow(2) - 4 * a * c))
    return torch.where(inside, root * bw + cw, y)


def _conv_flow(w: PiperWeights, prefix: str, z: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    half = z.shape[1] // 2
    z0, z1 = z[:, :half], z[:, half:]
    h = w.conv(f"{prefix}.pre")(z0)
    h = dds_conv(w, f"{prefix}.convs", h, g=cond)
    h = w.conv(f"{prefix}.proj")(h)
    b, c, t = z0.shape
    filters = h.shape[1] // c  # 3 * bins - 1
    bins = (filters + 1) // 3
    h = h.reshape(b, c, filters, t).permute(0, 1, 3, 2)
    scale = math.sqrt(w.conv(f"{prefix}.pre").weight.shape[0])
    z1 = inverse_rq_spline(
        z1, h[..., :bins] / scale, h[..., bins : 2 * bins] / scale, h[..., 2 * bins :]
    )
    return torch.cat([z0, z1], dim=1)


def duration_predictor(w: PiperWeights, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Encoder hidden x [1, C, T] and scaled noise [1, 2, T] -> log-durations [1, 1, T]."""
    h = w.conv("dp.pre")(x)
    h = dds_conv(w, "dp.convs", h)
    cond = w.conv("dp.proj")(h)
    conv_flows = sorted(
        {int(k.split(".")[2]) for k in w.convs if k.startswith("dp.flows.")}, reverse=True
    )
    z = noise
    for index in conv_flows:  # reverse order; each ConvFlow is preceded by a Flip
        if index == 1:
            continue  # the useless final vflow VITS drops at inference
        z = _conv_flow(w, f"dp.flows.{index}", torch.flip(z, [1]), cond)
    z = torch.flip(z, [1])
    z = (z - w.tensor("dp.flows.0.m")) * w.tensor("dp.flows.0.exp_neg_logs")
    return z[:, :1]
