"""Whisper's log-mel front end: the constants as data, the Slaney filterbank, the log-mel.

Matches openai-whisper's `log_mel_spectrogram` and transformers' `WhisperFeatureExtractor`:
a periodic Hann STFT (center, reflect pad), power spectrum, Slaney-scale and -normalised mel
filters, log10 with a floor, clamp to `dynamic_range` below the maximum, then (x + 4) / 4.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class MelSpec:
    """Front-end constants; Whisper v1-v2 use 80 bins, large-v3 and turbo 128."""

    n_mels: int = 80
    sample_rate: int = 16_000
    n_fft: int = 400
    hop_length: int = 160
    chunk_seconds: int = 30
    f_min: float = 0.0
    f_max: float = 8_000.0
    log_floor: float = 1e-10
    dynamic_range: float = 8.0  # log10 units kept below the peak
    offset: float = 4.0
    scale: float = 4.0

    @property
    def n_samples(self) -> int:
        """Samples in one model window (30 s)."""
        return self.chunk_seconds * self.sample_rate

    @property
    def n_frames(self) -> int:
        """Mel frames in one model window (3000)."""
        return self.n_samples // self.hop_length

    @property
    def frame_seconds(self) -> float:
        return self.hop_length / self.sample_rate


# Slaney mel scale (librosa's default, htk=False): linear below 1 kHz, logarithmic above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    lin = hz / _F_SP
    log = _MIN_LOG_MEL + np.log(np.maximum(hz, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOGSTEP
    return np.where(hz >= _MIN_LOG_HZ, log, lin)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    lin = _F_SP * mel
    log = _MIN_LOG_HZ * np.exp(_LOGSTEP * (np.maximum(mel, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(mel >= _MIN_LOG_MEL, log, lin)


def mel_filters(spec: MelSpec) -> np.ndarray:
    """The [n_mels, n_fft // 2 + 1] Slaney filterbank (float32), as librosa.filters.mel has it."""
    fft_freqs = np.linspace(0.0, spec.sample_rate / 2, spec.n_fft // 2 + 1)
    mels = np.linspace(_hz_to_mel(spec.f_min), _hz_to_mel(spec.f_max), spec.n_mels + 2)
    mel_f = _mel_to_hz(mels)
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2:] - mel_f[:-2])  # Slaney area normalisation
    return (weights * enorm[:, None]).astype(np.float32)


def log_mel(
    audio: np.ndarray | torch.Tensor,
    spec: MelSpec,
    filters: torch.Tensor | None = None,
    pad_to: int | None = None,
) -> torch.Tensor:
    """[n_mels, frames] log-mel of mono float audio; zero-padded at the end to `pad_to` samples.

    `frames` is `len(audio) // hop_length` after padding (the STFT's last frame is dropped).
    """
    wave = torch.as_tensor(audio, dtype=torch.float32).flatten()
    if pad_to is not None and len(wave) < pad_to:
        wave = torch.nn.functional.pad(wave, (0, pad_to - len(wave)))
    if len(wave) < spec.n_fft // 2 + 1:  # reflect padding needs more than n_fft / 2 samples
        wave = torch.nn.functional.pad(wave, (0, spec.n_fft // 2 + 1 - len(wave)))
    window = torch.hann_window(spec.n_fft)
    stft = torch.stft(wave, spec.n_fft, spec.hop_length, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    if filters is None:
        filters = torch.from_numpy(mel_filters(spec))
    mel = filters @ power
    logs = torch.clamp(mel, min=spec.log_floor).log10()
    logs = torch.maximum(logs, logs.max() - spec.dynamic_range)
    return (logs + spec.offset) / spec.scale
