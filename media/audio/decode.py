"""Audio decoding: any file soundfile reads (wav/flac/ogg/mp3) to mono float32 at a target rate.

`load_audio` reads a whole file; `stream_audio` yields fixed-size blocks so a two-hour file is
never held in memory at once. Both raise `AudioError` (a ValueError) with the file named.
"""

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 16_000
Source = str | Path | bytes


class AudioError(ValueError):
    """The input is not decodable audio (empty, not audio, truncated, or zero-length)."""


@dataclass(frozen=True)
class AudioInfo:
    """What the container header says: native rate, channels, frames and duration."""

    sample_rate: int
    channels: int
    frames: int

    @property
    def duration(self) -> float:
        return self.frames / self.sample_rate if self.sample_rate else 0.0


def _name(src: Source) -> str:
    return "<bytes>" if isinstance(src, bytes) else str(src)


def _open(src: Source) -> sf.SoundFile:
    if isinstance(src, bytes):
        if not src:
            raise AudioError("<bytes>: the audio is empty (0 bytes)")
        handle: str | io.BytesIO = io.BytesIO(src)
    else:
        path = Path(src)
        if not path.is_file():
            raise AudioError(f"{path}: no such audio file")
        if path.stat().st_size == 0:
            raise AudioError(f"{path}: the audio file is empty (0 bytes)")
        handle = str(path)
    try:
        return sf.SoundFile(handle)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"{_name(src)}: not a readable audio file ({e})") from None


def audio_info(src: Source) -> AudioInfo:
    """Header facts of `src` without decoding the samples."""
    with _open(src) as f:
        return AudioInfo(f.samplerate, f.channels, max(f.frames, 0))


def _mono(block: np.ndarray) -> np.ndarray:
    return block.mean(axis=1, dtype=np.float32) if block.ndim == 2 else block.astype(np.float32)


def stream_audio(
    src: Source, sample_rate: int = SAMPLE_RATE, block_seconds: float = 30.0
) -> Iterator[np.ndarray]:
    """Yield mono float32 blocks at `sample_rate`, about `block_seconds` each (bounded memory)."""
    if block_seconds <= 0:
        raise ValueError("block_seconds must be > 0")
    total = 0
    with _open(src) as f:
        rate = f.samplerate
        resampler = None if rate == sample_rate else soxr.ResampleStream(rate, sample_rate, 1)
        frames = max(1, int(block_seconds * rate))
        while True:
            try:
                raw = f.read(frames, dtype="float32", always_2d=True)
            except (sf.LibsndfileError, RuntimeError) as e:
                raise AudioError(f"{_name(src)}: truncated or corrupt audio ({e})") from None
            last = len(raw) < frames
            block = _mono(raw)
            if resampler is not None:
                block = resampler.resample_chunk(block, last=last).astype(np.float32)
            if len(block):
                total += len(block)
                yield block
            if last:
                break
    if total == 0:
        raise AudioError(f"{_name(src)}: the audio holds no samples (0 seconds)")


def load_audio(src: Source, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The whole of `src` as one mono float32 array at `sample_rate`."""
    return np.concatenate(list(stream_audio(src, sample_rate, block_seconds=600.0)))
