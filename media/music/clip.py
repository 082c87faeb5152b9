"""Audio in and out for music: a clip read with its channels kept (to continue it with a stereo
model), and generated (channels, samples) audio encoded to wav/flac/mp3/ogg/opus/pcm.

Mono goes through `media.audio` (decode, resample, encode) unchanged; stereo uses the same
libsndfile formats with two channels (`media.audio.encode` writes mono only).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from localllm.media.audio.decode import AudioError, load_audio
from localllm.media.audio.encode import AudioFormat, audio_format, encode

_OPUS_RATE = 48000  # Opus takes 8/12/16/24/48 kHz only; MusicGen's 32 kHz is resampled


def load_clip(path: str | Path | bytes, sample_rate: int, channels: int) -> np.ndarray:
    """(channels, samples) float32 at `sample_rate`: mono files are copied to both channels of a
    stereo request, stereo files averaged for a mono one. AudioError when it is not audio."""
    if channels == 1:
        return load_audio(path, sample_rate)[None]
    import soundfile as sf
    import soxr

    load_audio(path, sample_rate)  # the same checks and one-line errors as every other input
    src = io.BytesIO(path) if isinstance(path, bytes) else str(path)
    try:
        data, rate = sf.read(src, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioError(f"{path}: not a readable audio file ({e})") from None
    if data.shape[1] == 1:
        data = np.repeat(data, channels, axis=1)
    data = data[:, :channels]
    if rate != sample_rate:
        data = soxr.resample(data, rate, sample_rate).astype(np.float32)
    return np.ascontiguousarray(data.T)


def encode_music(samples: np.ndarray, sample_rate: int, fmt: AudioFormat | str) -> bytes:
    """A complete file of (channels, samples) audio in `fmt`."""
    fmt = audio_format(fmt) if isinstance(fmt, str) else fmt
    samples = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    if samples.shape[0] == 1:
        return encode(samples[0], sample_rate, fmt)
    frames = samples.T  # (samples, channels), interleaved when written
    if fmt.sf_format is None:  # raw pcm: s16le, interleaved
        return np.round(frames * 32767.0).astype("<i2").tobytes()
    import soundfile as sf

    if fmt.sf_subtype == "OPUS":
        import soxr

        frames = soxr.resample(frames, sample_rate, _OPUS_RATE).astype(np.float32)
        sample_rate = _OPUS_RATE
    out = io.BytesIO()
    with sf.SoundFile(
        out, "w", sample_rate, frames.shape[1], fmt.sf_subtype, format=fmt.sf_format,
        compression_level=fmt.compression_level, bitrate_mode=fmt.bitrate_mode,
    ) as f:  # fmt: skip
        f.write(frames)
    return out.getvalue()
