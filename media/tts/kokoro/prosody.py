"""Kokoro's text-side networks: the phoneme TextEncoder (CNN + BiLSTM) that feeds the decoder,
and the ProsodyPredictor (style-conditioned duration encoder, duration head, F0 and energy
curves from AdaIN residual blocks).

Shapes: channels-first [B, C, T] between convolutions, [B, T, C] around LSTMs. Inference only
(dropout is a no-op), one unpadded sequence per batch row, so no masks are needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localllm.media.tts.kokoro.layers import AdainResBlk1d, AdaLayerNorm, ChannelLayerNorm

_TEXT_SLOPE = 0.2


class BiLSTM(nn.Module):
    """One-layer bidirectional LSTM over [B, T, C] with nn.LSTM's parameter names.

    Evaluated step by step: in inference on CPU, torch's oneDNN LSTM kernel runs ~40x slower
    than this loop (1 s against 25 ms for 30 steps of Kokoro's size, torch 2.13)."""

    def __init__(self, size_in: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        for suffix in ("", "_reverse"):
            self.register_parameter(
                f"weight_ih_l0{suffix}", nn.Parameter(torch.randn(4 * hidden, size_in) * 0.05)
            )
            self.register_parameter(
                f"weight_hh_l0{suffix}", nn.Parameter(torch.randn(4 * hidden, hidden) * 0.05)
            )
            self.register_parameter(f"bias_ih_l0{suffix}", nn.Parameter(torch.zeros(4 * hidden)))
            self.register_parameter(f"bias_hh_l0{suffix}", nn.Parameter(torch.zeros(4 * hidden)))

    def _direction(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        w_hh = getattr(self, f"weight_hh_l0{suffix}").T
        bias = getattr(self, f"bias_ih_l0{suffix}") + getattr(self, f"bias_hh_l0{suffix}")
        gates_x = F.linear(x, getattr(self, f"weight_ih_l0{suffix}"), bias)
        h = x.new_zeros(x.shape[0], self.hidden)
        c = torch.zeros_like(h)
        out = []
        for t in range(x.shape[1]):
            # PyTorch's gate order: input, forget, cell, output
            i, f, g, o = (gates_x[:, t] + h @ w_hh).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            out.append(h)
        return torch.stack(out, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backward = self._direction(x.flip(1), "_reverse").flip(1)
        return torch.cat([self._direction(x, ""), backward], dim=-1)


def _bilstm(size_in: int, hidden: int) -> BiLSTM:
    return BiLSTM(size_in, hidden)


class _ConvNormAct(nn.Sequential):
    """conv -> channel LayerNorm -> LeakyReLU; indices 0 and 1 match the checkpoint's keys."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2),
            ChannelLayerNorm(channels),
            nn.LeakyReLU(_TEXT_SLOPE),
        )


class TextEncoder(nn.Module):
    """Phoneme ids [B, T] -> acoustic text features [B, C, T]."""

    def __init__(self, channels: int, kernel_size: int, depth: int, n_symbols: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, channels)
        self.cnn = nn.ModuleList(_ConvNormAct(channels, kernel_size) for _ in range(depth))
        self.lstm = _bilstm(channels, channels // 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids).transpose(1, 2)
        for block in self.cnn:
            x = block(x)
        return self.lstm(x.transpose(1, 2)).transpose(1, 2)


class DurationEncoder(nn.Module):
    """Alternating BiLSTM / AdaLayerNorm layers, the style re-appended after each norm.

    `lstms` holds both kinds, in the checkpoint's order (even = LSTM, odd = norm).
    Input [B, d_model, T]; output [B, T, d_model + style_dim]."""

    def __init__(self, style_dim: int, d_model: int, nlayers: int) -> None:
        super().__init__()
        self.lstms = nn.ModuleList()
        for _ in range(nlayers):
            self.lstms.append(_bilstm(d_model + style_dim, d_model // 2))
            self.lstms.append(AdaLayerNorm(style_dim, d_model))

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        s = style.unsqueeze(1).expand(-1, x.shape[2], -1)
        x = torch.cat([x.transpose(1, 2), s], dim=-1)
        for block in self.lstms:
            if isinstance(block, AdaLayerNorm):
                x = torch.cat([block(x, style), s], dim=-1)
            else:
                x = block(x)
        return x


class ProsodyPredictor(nn.Module):
    """Durations (per phoneme) and F0 / energy curves (per frame, at twice the frame rate)."""

    def __init__(self, style_dim: int, d_hid: int, nlayers: int, max_dur: int) -> None:
        super().__init__()
        self.text_encoder = DurationEncoder(style_dim, d_hid, nlayers)
        self.lstm = _bilstm(d_hid + style_dim, d_hid // 2)
        self.duration_proj = nn.Module()
        self.duration_proj.linear_layer = nn.Linear(d_hid, max_dur)
        self.shared = _bilstm(d_hid + style_dim, d_hid // 2)
        self.F0 = self._curve_blocks(d_hid, style_dim)
        self.N = self._curve_blocks(d_hid, style_dim)
        self.F0_proj = nn.Conv1d(d_hid // 2, 1, 1)
        self.N_proj = nn.Conv1d(d_hid // 2, 1, 1)

    @staticmethod
    def _curve_blocks(d_hid: int, style_dim: int) -> nn.ModuleList:
        return nn.ModuleList(
            [
                AdainResBlk1d(d_hid, d_hid, style_dim),
                AdainResBlk1d(d_hid, d_hid // 2, style_dim, upsample=True),
                AdainResBlk1d(d_hid // 2, d_hid // 2, style_dim),
            ]
        )

    def durations(self, d: torch.Tensor, speed: float) -> torch.Tensor:
        """Encoded text [B, T, C] -> expected frames per phoneme (float, before rounding)."""
        x = self.lstm(d)
        logits = self.duration_proj.linear_layer(x)
        return torch.sigmoid(logits).sum(dim=-1) / speed

    def curves(self, en: torch.Tensor, style: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Aligned features [B, C, F] -> (F0, N), each [B, 2F]."""
        x = self.shared(en.transpose(1, 2)).transpose(1, 2)
        f0, n = x, x
        for block in self.F0:
            f0 = block(f0, style)
        for block in self.N:
            n = block(n, style)
        return self.F0_proj(f0).squeeze(1), self.N_proj(n).squeeze(1)


def alignment(durations: torch.Tensor) -> torch.Tensor:
    """Integer frames per phoneme [T] -> a 0/1 alignment matrix [1, T, sum(durations)]."""
    index = torch.repeat_interleave(torch.arange(durations.shape[0]), durations)
    return F.one_hot(index, durations.shape[0]).T.unsqueeze(0).float()
