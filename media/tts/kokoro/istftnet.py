"""Kokoro's decoder: AdaIN residual blocks over (text features, F0, energy), then an iSTFTNet
generator (transposed-conv upsampling with Snake AdaIN resblocks, the harmonic source injected at
every scale, a magnitude/phase head and an inverse STFT) -> 24 kHz waveform.

The channel widths 1024 / 512 / 64 are fixed by the architecture, not the config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from localllm.media.tts.kokoro.layers import AdaIN1d, AdainResBlk1d
from localllm.media.tts.kokoro.source import SourceModuleHnNSF

SAMPLE_RATE = 24_000
_UP_SLOPE = 0.1
_POST_SLOPE = 0.01  # F.leaky_relu's default, used once before conv_post
_DECODE_DIM = 1024
_ASR_RES_DIM = 64


@dataclass(frozen=True)
class IstftConfig:
    """The `istftnet` block of Kokoro's config.json."""

    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    upsample_initial_channel: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    gen_istft_n_fft: int
    gen_istft_hop_size: int


def _padding(kernel: int, dilation: int) -> int:
    return (kernel * dilation - dilation) // 2


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return x + (1 / alpha) * torch.sin(alpha * x) ** 2


class AdaINResBlock1(nn.Module):
    """HiFi-GAN resblock with AdaIN before each conv and Snake activations (learned alpha)."""

    def __init__(
        self, channels: int, kernel: int, dilations: tuple[int, ...], style_dim: int
    ) -> None:
        super().__init__()
        n = len(dilations)
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=_padding(kernel, d))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=_padding(kernel, 1)) for _ in range(n)
        )
        self.adain1 = nn.ModuleList(AdaIN1d(style_dim, channels) for _ in range(n))
        self.adain2 = nn.ModuleList(AdaIN1d(style_dim, channels) for _ in range(n))
        self.alpha1 = nn.ParameterList(nn.Parameter(torch.ones(1, channels, 1)) for _ in range(n))
        self.alpha2 = nn.ParameterList(nn.Parameter(torch.ones(1, channels, 1)) for _ in range(n))

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        for c1, c2, n1, n2, a1, a2 in zip(
            self.convs1,
            self.convs2,
            self.adain1,
            self.adain2,
            self.alpha1,
            self.alpha2,
            strict=True,
        ):
            xt = c1(_snake(n1(x, style), a1))
            xt = c2(_snake(n2(xt, style), a2))
            x = xt + x
        return x


class Generator(nn.Module):
    def __init__(self, style_dim: int, cfg: IstftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.upsample = math.prod(cfg.upsample_rates) * cfg.gen_istft_hop_size
        self.m_source = SourceModuleHnNSF(SAMPLE_RATE, self.upsample)
        n_fft, kernels = cfg.gen_istft_n_fft, cfg.resblock_kernel_sizes
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        self.noise_convs = nn.ModuleList()
        self.noise_res = nn.ModuleList()
        last = len(cfg.upsample_rates) - 1
        for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)):
            ch = cfg.upsample_initial_channel // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(2 * ch, ch, k, u, padding=(k - u) // 2))
            for kernel, dilations in zip(kernels, cfg.resblock_dilation_sizes, strict=True):
                self.resblocks.append(AdaINResBlock1(ch, kernel, tuple(dilations), style_dim))
            if i < last:
                stride = math.prod(cfg.upsample_rates[i + 1 :])
                conv = nn.Conv1d(n_fft + 2, ch, stride * 2, stride, padding=(stride + 1) // 2)
                self.noise_convs.append(conv)
                self.noise_res.append(AdaINResBlock1(ch, 7, (1, 3, 5), style_dim))
            else:
                self.noise_convs.append(nn.Conv1d(n_fft + 2, ch, 1))
                self.noise_res.append(AdaINResBlock1(ch, 11, (1, 3, 5), style_dim))
        self.conv_post = nn.Conv1d(ch, n_fft + 2, 7, 1, padding=3)
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def _harmonics(self, f0: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """F0 curve [B, F2] -> STFT magnitude and phase of the excitation [B, n_fft + 2, S]."""
        f0 = F.interpolate(f0[:, None], scale_factor=self.upsample).transpose(1, 2)
        source = self.m_source(f0, generator).transpose(1, 2).squeeze(1)
        n_fft, hop = self.cfg.gen_istft_n_fft, self.cfg.gen_istft_hop_size
        spec = torch.stft(source, n_fft, hop, n_fft, window=self.window, return_complex=True)
        return torch.cat([spec.abs(), spec.angle()], dim=1)

    def forward(
        self,
        x: torch.Tensor,
        style: torch.Tensor,
        f0: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        har = self._harmonics(f0, generator)
        kernels = len(self.cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = F.leaky_relu(x, _UP_SLOPE)
            x_source = self.noise_res[i](self.noise_convs[i](har), style)
            x = up(x)
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + x_source
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            xs = blocks[0](x, style)
            for block in blocks[1:]:
                xs = xs + block(x, style)
            x = xs / kernels
        x = self.conv_post(F.leaky_relu(x, _POST_SLOPE))
        bins = self.cfg.gen_istft_n_fft // 2 + 1
        spec = torch.exp(x[:, :bins]) * torch.exp(torch.sin(x[:, bins:]) * 1j)
        n_fft, hop = self.cfg.gen_istft_n_fft, self.cfg.gen_istft_hop_size
        return torch.istft(spec, n_fft, hop, n_fft, window=self.window)


class Decoder(nn.Module):
    """(aligned text features [B, C, F], F0 [B, 2F], N [B, 2F], style [B, S]) -> audio [B, L]."""

    def __init__(self, dim_in: int, style_dim: int, cfg: IstftConfig) -> None:
        super().__init__()
        cat = _DECODE_DIM + 2 + _ASR_RES_DIM
        self.encode = AdainResBlk1d(dim_in + 2, _DECODE_DIM, style_dim)
        self.decode = nn.ModuleList(
            [
                AdainResBlk1d(cat, _DECODE_DIM, style_dim),
                AdainResBlk1d(cat, _DECODE_DIM, style_dim),
                AdainResBlk1d(cat, _DECODE_DIM, style_dim),
                AdainResBlk1d(cat, cfg.upsample_initial_channel, style_dim, upsample=True),
            ]
        )
        self.F0_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.N_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.asr_res = nn.Sequential(nn.Conv1d(dim_in, _ASR_RES_DIM, 1))
        self.generator = Generator(style_dim, cfg)

    def forward(
        self,
        asr: torch.Tensor,
        f0: torch.Tensor,
        n: torch.Tensor,
        style: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        f0_down = self.F0_conv(f0.unsqueeze(1))
        n_down = self.N_conv(n.unsqueeze(1))
        x = self.encode(torch.cat([asr, f0_down, n_down], dim=1), style)
        asr_res = self.asr_res(asr)
        for block in self.decode:
            # the residual inputs are re-appended until the upsampling block
            x = block(torch.cat([x, asr_res, f0_down, n_down], dim=1), style)
        return self.generator(x, style, f0, generator)
