"""Piper (VITS) inference graph in plain torch: text encoder -> stochastic durations -> expand
the prior -> sample -> reverse normalizing flow -> HiFi-GAN decoder -> waveform.

Weights come from `read_piper_onnx`; `PiperVits.infer` matches Piper's exported `infer`
(scales = noise_scale, length_scale, noise_w). Noise can be passed in, so the same draws can be
fed to onnxruntime for a bit-for-bit-comparable reference run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localllm.media.tts.onnx_weights import PiperWeights, VoiceFormatError
from localllm.media.tts.vits_duration import duration_predictor
from localllm.media.tts.vits_text import text_encoder

_LRELU_SLOPE = 0.1


@dataclass(frozen=True)
class VitsScales:
    """Piper inference scales: prior noise, duration multiplier (1/speed), duration noise."""

    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8


def _wavenet(w: PiperWeights, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Non-causal WaveNet (gated tanh*sigmoid, residual + skip) of a coupling layer."""
    out = torch.zeros_like(x)
    hidden = x.shape[1]
    i = 0
    while f"{prefix}.in_layers.{i}" in w.convs:
        x_in = w.conv(f"{prefix}.in_layers.{i}")(x)
        acts = torch.tanh(x_in[:, :hidden]) * torch.sigmoid(x_in[:, hidden:])
        res_skip = w.conv(f"{prefix}.res_skip_layers.{i}")(acts)
        if f"{prefix}.in_layers.{i + 1}" in w.convs:
            x = x + res_skip[:, :hidden]
            out = out + res_skip[:, hidden:]
        else:
            out = out + res_skip
        i += 1
    return out


def reverse_flow(w: PiperWeights, z: torch.Tensor) -> torch.Tensor:
    """Mean-only residual coupling layers with Flips between, run last to first."""
    layers = sorted({int(k.split(".")[2]) for k in w.convs if k.startswith("flow.flows.")})
    for index in reversed(layers):
        z = torch.flip(z, [1])
        half = z.shape[1] // 2
        z0, z1 = z[:, :half], z[:, half:]
        h = w.conv(f"flow.flows.{index}.pre")(z0)
        h = _wavenet(w, f"flow.flows.{index}.enc", h)
        z = torch.cat([z0, z1 - w.conv(f"flow.flows.{index}.post")(h)], dim=1)
    return z


def _resblock(w: PiperWeights, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """HiFi-GAN residual block: ResBlock2 (`convs.N`, medium/low voices) or ResBlock1
    (`convs1.N` + `convs2.N`, high-quality voices)."""
    if f"{prefix}.convs.0" in w.convs:
        c = 0
        while f"{prefix}.convs.{c}" in w.convs:
            x = x + w.conv(f"{prefix}.convs.{c}")(F.leaky_relu(x, _LRELU_SLOPE))
            c += 1
        return x
    if f"{prefix}.convs1.0" not in w.convs:
        raise VoiceFormatError(f"{prefix}: unknown HiFi-GAN residual block layout")
    c = 0
    while f"{prefix}.convs1.{c}" in w.convs:
        y = w.conv(f"{prefix}.convs1.{c}")(F.leaky_relu(x, _LRELU_SLOPE))
        x = x + w.conv(f"{prefix}.convs2.{c}")(F.leaky_relu(y, _LRELU_SLOPE))
        c += 1
    return x


def hifigan(w: PiperWeights, z: torch.Tensor) -> torch.Tensor:
    """HiFi-GAN generator (ResBlock2 variant): latent frames [1, C, F] -> audio [1, 1, F*hop]."""
    x = w.conv("dec.conv_pre")(z)
    ups = sorted({int(k.split(".")[2]) for k in w.convs if k.startswith("dec.ups.")})
    blocks = sorted({int(k.split(".")[2]) for k in w.convs if k.startswith("dec.resblocks.")})
    per_up = len(blocks) // len(ups)
    for u in ups:
        x = w.conv(f"dec.ups.{u}")(F.leaky_relu(x, _LRELU_SLOPE))
        total = None
        for j in range(per_up):
            prefix = f"dec.resblocks.{u * per_up + j}"
            y = _resblock(w, prefix, x)
            total = y if total is None else total + y
        assert total is not None
        x = total / per_up
    x = w.conv("dec.conv_post")(F.leaky_relu(x))  # default slope 0.01, as in VITS
    return torch.tanh(x)


class PiperVits:
    """A loaded Piper voice graph. Stateless between calls; safe to share across threads."""

    def __init__(self, weights: PiperWeights) -> None:
        self.weights = weights
        self.hop = 1
        for k, spec in weights.convs.items():
            if k.startswith("dec.ups."):
                self.hop *= spec.stride

    @torch.inference_mode()
    def infer(
        self,
        ids: torch.Tensor,
        scales: VitsScales,
        noise_dp: torch.Tensor | None = None,
        noise_z: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Phoneme ids [1, T] -> float audio [samples] in [-1, 1].

        noise_dp [1, 2, T] and noise_z [1, C, frames] are standard-normal draws (scaled
        here); when omitted they are sampled from `generator`.
        """
        w = self.weights
        x, m_p, logs_p = text_encoder(w, ids)
        if noise_dp is None:
            noise_dp = torch.randn(1, 2, ids.shape[1], generator=generator)
        logw = duration_predictor(w, x, noise_dp * scales.noise_w)
        dur = torch.ceil(torch.exp(logw) * scales.length_scale)[0, 0].long()
        frames = max(int(dur.sum()), 1)
        m = torch.repeat_interleave(m_p[0], dur, dim=1)
        logs = torch.repeat_interleave(logs_p[0], dur, dim=1)
        if m.shape[1] < frames:  # all durations rounded to zero: one silent frame
            m = F.pad(m, [0, frames - m.shape[1]])
            logs = F.pad(logs, [0, frames - logs.shape[1]])
        if noise_z is None:
            noise_z = torch.randn(1, m.shape[0], frames, generator=generator)
        z_p = m[None] + noise_z * torch.exp(logs[None]) * scales.noise_scale
        return hifigan(w, reverse_flow(w, z_p)).reshape(-1)
