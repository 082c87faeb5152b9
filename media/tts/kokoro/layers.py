"""Style-conditioned building blocks shared by Kokoro's prosody predictor and decoder: channel
LayerNorm, AdaLayerNorm, AdaIN, and the AdaIN residual block (optionally upsampling x2).

Attribute names follow the checkpoint's keys (`norm1.fc`, `conv1x1`, `pool`, ...) so a state dict
loads as is once weight norm is folded (see `checkpoint.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ADAIN_SLOPE = 0.2
_INV_SQRT2 = 2**-0.5


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channel axis of a [B, C, T] tensor (`gamma`/`beta` keys)."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, -1), (x.shape[1],), self.gamma, self.beta, self.eps)
        return y.transpose(1, -1)


class AdaLayerNorm(nn.Module):
    """LayerNorm over the last axis of [B, T, C], scaled and shifted by a style vector."""

    def __init__(self, style_dim: int, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.fc = nn.Linear(style_dim, channels * 2)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.fc(style).unsqueeze(1).chunk(2, dim=-1)
        return (1 + gamma) * F.layer_norm(x, (self.channels,), eps=self.eps) + beta


class AdaIN1d(nn.Module):
    """Instance norm of [B, C, T] scaled and shifted by a style vector.

    The norm's own affine weights default to identity: StyleTTS2 trained without them, so a
    checkpoint may not store them (the reference keeps them only for an ONNX export bug)."""

    def __init__(self, style_dim: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(channels, affine=True)
        self.fc = nn.Linear(style_dim, channels * 2)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.fc(style).unsqueeze(-1).chunk(2, dim=1)
        return (1 + gamma) * self.norm(x) + beta


class AdainResBlk1d(nn.Module):
    """StyleTTS2's AdaIN residual block: (AdaIN, LeakyReLU, [depthwise x2 upsample], conv) x2,
    plus a (nearest-upsampled, 1x1-projected) shortcut, summed and scaled by 1/sqrt(2)."""

    def __init__(self, dim_in: int, dim_out: int, style_dim: int, upsample: bool = False) -> None:
        super().__init__()
        self.upsample = upsample
        self.conv1 = nn.Conv1d(dim_in, dim_out, 3, 1, 1)
        self.conv2 = nn.Conv1d(dim_out, dim_out, 3, 1, 1)
        self.norm1 = AdaIN1d(style_dim, dim_in)
        self.norm2 = AdaIN1d(style_dim, dim_out)
        self.conv1x1 = nn.Conv1d(dim_in, dim_out, 1, bias=False) if dim_in != dim_out else None
        self.pool = (
            nn.ConvTranspose1d(
                dim_in, dim_in, 3, stride=2, groups=dim_in, padding=1, output_padding=1
            )
            if upsample
            else None
        )

    def _residual(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.norm1(x, style), _ADAIN_SLOPE)
        if self.pool is not None:
            x = self.pool(x)
        x = self.conv1(x)
        x = F.leaky_relu(self.norm2(x, style), _ADAIN_SLOPE)
        return self.conv2(x)

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.upsample:
            x = F.interpolate(x, scale_factor=2, mode="nearest")
        return self.conv1x1(x) if self.conv1x1 is not None else x

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        return (self._residual(x, style) + self._shortcut(x)) * _INV_SQRT2
