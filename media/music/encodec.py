"""EnCodec (SEANet convolutions + residual vector quantizer), the codec MusicGen's codes
belong to: `decode` turns (K, frames) codes into a waveform, `encode` a waveform into codes
(for continuing a clip). One channel per call; stereo models run it per channel.

Matches transformers' EncodecModel without chunking or normalization (MusicGen's codecs use
neither): asymmetric "same" padding with reflect mode, weight-normed convolutions (folded into
plain weights at load), an LSTM with a residual, and nearest-codeword RVQ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from localllm.media.music.config import EncodecArgs
from localllm.media.music.weights import Weights


def _weight(w: Weights, base: str) -> torch.Tensor:
    """A conv's weight with weight norm folded in: g * v / |v| (norm over all but dim 0)."""
    if f"{base}.parametrizations.weight.original0" in w:
        g = w.get(f"{base}.parametrizations.weight.original0")
        v = w.get(f"{base}.parametrizations.weight.original1")
    elif f"{base}.weight_g" in w:
        g, v = w.get(f"{base}.weight_g"), w.get(f"{base}.weight_v")
    else:
        return w.get(f"{base}.weight")
    return v * (g / v.norm(dim=tuple(range(1, v.dim())), keepdim=True))


class _Conv:
    def __init__(self, a: EncodecArgs, w: Weights, base: str, stride=1, dilation=1):
        self.weight, self.bias = _weight(w, f"{base}.conv"), w.get(f"{base}.conv.bias")
        self.stride, self.dilation, self.a = stride, dilation, a
        self.kernel = (self.weight.shape[-1] - 1) * dilation + 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        total = self.kernel - self.stride
        length = x.shape[-1]
        frames = math.ceil((length - self.kernel + total) / self.stride + 1) - 1
        extra = frames * self.stride + self.kernel - total - length
        if self.a.causal:
            left, right = total, extra
        else:
            right = total // 2
            left, right = total - right, right + extra
        x = _pad(x, left, right, self.a.pad_mode)
        return F.conv1d(x, self.weight, self.bias, self.stride, dilation=self.dilation)


def _pad(x: torch.Tensor, left: int, right: int, mode: str) -> torch.Tensor:
    if mode != "reflect":
        return F.pad(x, (left, right), mode)
    extra = max(0, max(left, right) - x.shape[-1] + 1)  # reflect needs a longer input
    if extra:
        x = F.pad(x, (0, extra))
    out = F.pad(x, (left, right), "reflect")
    return out[..., : out.shape[-1] - extra]


class _ConvT:
    def __init__(self, a: EncodecArgs, w: Weights, base: str, stride: int):
        self.weight, self.bias = _weight(w, f"{base}.conv"), w.get(f"{base}.conv.bias")
        self.stride, self.a = stride, a

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = F.conv_transpose1d(x, self.weight, self.bias, self.stride)
        total = self.weight.shape[-1] - self.stride
        right = math.ceil(total * self.a.trim_right_ratio) if self.a.causal else total // 2
        return x[..., total - right : x.shape[-1] - right]


class _Residual:
    def __init__(self, a: EncodecArgs, w: Weights, base: str, dilations: tuple[int, int]):
        kernels = (a.residual_kernel_size, 1)
        self.convs = [
            _Conv(a, w, f"{base}.block.{2 * i + 1}", dilation=d)
            for i, (_, d) in enumerate(zip(kernels, dilations, strict=True))
        ]
        self.shortcut = _Conv(a, w, f"{base}.shortcut") if a.use_conv_shortcut else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for conv in self.convs:
            h = conv(F.elu(h))
        return (self.shortcut(x) if self.shortcut else x) + h


class _LSTM:
    def __init__(self, a: EncodecArgs, w: Weights, base: str, dim: int):
        self.lstm = torch.nn.LSTM(dim, dim, a.num_lstm_layers).to(w.device, w.dtype)
        state = {n: w.get(f"{base}.lstm.{n}") for n, _ in self.lstm.named_parameters()}
        self.lstm.load_state_dict(state)
        self.lstm.eval()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.permute(2, 0, 1)  # (time, batch, dim)
        return (self.lstm(h)[0] + h).permute(1, 2, 0)


def _elu(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x)


class Encodec:
    """EnCodec's decoder, encoder and quantizer under `prefix` (`audio_encoder.`)."""

    def __init__(self, args: EncodecArgs, w: Weights, prefix: str = "audio_encoder."):
        self.args = args
        self.decoder = self._decoder(args, w, f"{prefix}decoder.layers")
        self.encoder = self._encoder(args, w, f"{prefix}encoder.layers")
        self.codebooks = torch.stack([
            w.get(f"{prefix}quantizer.layers.{i}.codebook.embed",
                  (args.codebook_size, args.codebook_dim))
            for i in range(args.num_quantizers)
        ])  # fmt: skip

    @staticmethod
    def _decoder(a: EncodecArgs, w: Weights, p: str) -> list:
        scale = 2 ** len(a.upsampling_ratios)
        layers: list = [_Conv(a, w, f"{p}.0"), _LSTM(a, w, f"{p}.1", scale * a.num_filters)]
        i = 2
        for ratio in a.upsampling_ratios:
            layers += [_elu, _ConvT(a, w, f"{p}.{i + 1}", ratio)]
            i += 2
            for j in range(a.num_residual_layers):
                layers.append(_Residual(a, w, f"{p}.{i}", (a.dilation_growth_rate**j, 1)))
                i += 1
        return [*layers, _elu, _Conv(a, w, f"{p}.{i + 1}")]

    @staticmethod
    def _encoder(a: EncodecArgs, w: Weights, p: str) -> list:
        layers: list = [_Conv(a, w, f"{p}.0")]
        i = 1
        for ratio in reversed(a.upsampling_ratios):
            for j in range(a.num_residual_layers):
                layers.append(_Residual(a, w, f"{p}.{i}", (a.dilation_growth_rate**j, 1)))
                i += 1
            layers += [_elu, _Conv(a, w, f"{p}.{i + 1}", stride=ratio)]
            i += 2
        dim = 2 ** len(a.upsampling_ratios) * a.num_filters
        return [*layers, _LSTM(a, w, f"{p}.{i}", dim), _elu, _Conv(a, w, f"{p}.{i + 2}")]

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(batch, Q, frames) codes to (batch, samples) audio, frames * hop_length samples."""
        x = sum(F.embedding(codes[:, q], self.codebooks[q]) for q in range(codes.shape[1]))
        x = x.transpose(1, 2)
        for layer in self.decoder:
            x = layer(x)
        return x[:, 0]

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """(batch, samples) audio to (batch, Q, frames) codes."""
        x = audio[:, None].to(self.codebooks.dtype)
        for layer in self.encoder:
            x = layer(x)
        residual = x.transpose(1, 2)  # (batch, frames, dim)
        codes = []
        for book in self.codebooks:
            # transformers' distance, term for term, so ties break the same way
            dist = -(
                residual.pow(2).sum(-1, keepdim=True) - 2 * residual @ book.T
                + book.pow(2).sum(-1)[None, None]
            )  # fmt: skip
            idx = dist.argmax(-1)
            codes.append(idx)
            residual = residual - F.embedding(idx, book)
        return torch.stack(codes, dim=1)
