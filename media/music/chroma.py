"""MusicGen-Melody's melody condition: the chromagram of an audio clip, as transformers'
MusicgenMelodyFeatureExtractor computes it (a power STFT, librosa's chroma filter bank, and the
loudest pitch class of each frame one-hot), then the model's prefix (projected and tiled).

The filter bank is librosa's `chroma` construction (the extractor builds it with
`num_frequency_bins = n_fft`, and so do we, to give the same matrix).
"""

from __future__ import annotations

import numpy as np
import torch

from localllm.media.music.config import ChromaArgs


def chroma_filters(sampling_rate: int, n_fft: int, num_chroma: int = 12) -> np.ndarray:
    """(num_chroma, n_fft // 2 + 1) weights projecting power-spectrum bins onto pitch classes."""
    freqs = np.linspace(0, sampling_rate, n_fft, endpoint=False)[1:]
    bins = num_chroma * np.log2(freqs / (440.0 / 16))  # octaves above A0 - 4, in chroma bins
    # the 0 Hz bin: 1.5 octaves below bin 1 (librosa's choice: broad, half rotated)
    bins = np.concatenate(([bins[0] - 1.5 * num_chroma], bins))
    widths = np.concatenate((np.maximum(bins[1:] - bins[:-1], 1.0), [1]))
    d = np.subtract.outer(bins, np.arange(0, num_chroma, dtype="d")).T
    half = np.round(float(num_chroma) / 2)
    d = np.remainder(d + half + 10 * num_chroma, num_chroma) - half
    filt = np.exp(-0.5 * (2 * d / np.tile(widths, (num_chroma, 1))) ** 2)
    filt = filt / np.sum(filt**2, axis=0, keepdims=True) ** 0.5
    # Gaussian weighting around octave 5 (half-width 2 octaves)
    filt *= np.tile(np.exp(-0.5 * ((bins / num_chroma - 5.0) / 2.0) ** 2), (num_chroma, 1))
    filt = np.roll(filt, -3 * (num_chroma // 12), axis=0)  # start at C, not A
    return np.ascontiguousarray(filt[:, : int(1 + n_fft / 2)])


def chroma(audio: np.ndarray, args: ChromaArgs) -> torch.Tensor:
    """(frames, num_chroma) one-hot chroma of mono float audio at `args.sampling_rate`
    (truncated to `args.max_seconds`, as the extractor does)."""
    wav = torch.from_numpy(np.asarray(audio, dtype=np.float32))
    wav = wav[: int(args.max_seconds * args.sampling_rate)]
    if wav.shape[-1] < args.n_fft:  # shorter than one window: zero-padded around
        pad = args.n_fft - wav.shape[-1]
        wav = torch.nn.functional.pad(wav, (pad // 2, pad // 2 + pad % 2))
    window = torch.hann_window(args.n_fft)
    spec = torch.stft(
        wav[None], args.n_fft, args.hop_length, window=window, center=True,
        pad_mode="reflect", return_complex=True,
    )  # fmt: skip
    spec = (spec / window.pow(2).sum().sqrt()).abs().pow(2)[0]  # (freq, frames)
    filt = torch.from_numpy(chroma_filters(args.sampling_rate, args.n_fft, args.num_chroma))
    raw = filt.float() @ spec  # (chroma, frames)
    norm = raw / raw.abs().amax(0, keepdim=True).clamp(min=1e-6)
    idx = norm.T.argmax(-1)
    return torch.nn.functional.one_hot(idx, args.num_chroma).float()


def null_chroma(args: ChromaArgs) -> torch.Tensor:
    """The condition of "no melody": one frame with pitch class 0 set (transformers' choice,
    also the unconditional row of classifier-free guidance)."""
    out = torch.zeros(1, args.num_chroma)
    out[0, 0] = 1
    return out


def tile_prefix(states: torch.Tensor, length: int) -> torch.Tensor:
    """(batch, frames, hidden) repeated whole until `length` frames, then cut to `length`."""
    if states.shape[1] < length:
        states = states.repeat(1, -(-length // states.shape[1]), 1)
    return states[:, :length]
