"""The harmonic-plus-noise excitation of Kokoro's iSTFTNet (hn-NSF): F0 at the sample rate ->
9 harmonics with a random initial phase per overtone, noise where unvoiced, merged to one
channel by a linear layer and tanh.

Randomness comes from an explicit `torch.Generator` (None = torch's global one), drawn in the
reference implementation's order (initial phases, then additive noise), so a seed reproduces it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

HARMONICS = 8  # overtones above F0 (9 sine channels in all)
SINE_AMP = 0.1
NOISE_STD = 0.003
VOICED_THRESHOLD = 10.0


def sine_source(
    f0: torch.Tensor, sample_rate: int, upsample: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """F0 per sample [B, L, 1] -> harmonic excitation [B, L, HARMONICS + 1].

    Phase is integrated at the frame rate (L / upsample) and interpolated back, as in training,
    which keeps long cumulative sums in float32 accurate."""
    orders = torch.arange(1, HARMONICS + 2, dtype=f0.dtype, device=f0.device)
    fn = f0 * orders
    rad = (fn / sample_rate) % 1
    initial = torch.rand(fn.shape[0], fn.shape[2], generator=generator, device=f0.device)
    initial[:, 0] = 0  # the fundamental starts at phase 0
    rad[:, 0, :] = rad[:, 0, :] + initial
    rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / upsample, mode="linear")
    phase = torch.cumsum(rad, dim=2) * 2 * math.pi
    phase = F.interpolate(phase * upsample, scale_factor=upsample, mode="linear")
    sines = torch.sin(phase.transpose(1, 2)) * SINE_AMP
    voiced = (f0 > VOICED_THRESHOLD).to(f0.dtype)
    noise_amp = voiced * NOISE_STD + (1 - voiced) * SINE_AMP / 3
    # empty_like keeps the sines' (transposed) strides, so the normal draws fill memory in the
    # same order as the reference's randn_like and a seed gives the same noise
    noise = torch.empty_like(sines).normal_(generator=generator) * noise_amp
    return sines * voiced + noise


class SourceModuleHnNSF(nn.Module):
    """Harmonics merged into a single excitation channel (`l_linear` key)."""

    def __init__(self, sample_rate: int, upsample: int) -> None:
        super().__init__()
        self.sample_rate = sample_rate
        self.upsample = upsample
        self.l_linear = nn.Linear(HARMONICS + 1, 1)

    def forward(self, f0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """F0 per sample [B, L, 1] -> excitation [B, L, 1]."""
        sines = sine_source(f0, self.sample_rate, self.upsample, generator)
        return torch.tanh(self.l_linear(sines))
