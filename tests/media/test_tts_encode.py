"""media/audio/encode.py: every output format round-trips through soundfile (lossless ones
bit-exactly after int16 rounding, lossy ones keep the tone), streams emit bytes before close,
and unsupported formats fail with a clear message."""

import io

import numpy as np
import pytest
import soundfile as sf

from localllm.media.audio.encode import (
    FORMAT_NAMES,
    StreamEncoder,
    UnsupportedFormatError,
    audio_format,
    encode,
    format_for_path,
    write_stream,
)

SR = 22050


def tone(seconds: float = 1.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def decode(data: bytes, name: str) -> tuple[np.ndarray, int]:
    if name == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, SR
    y, rate = sf.read(io.BytesIO(data), dtype="float32")
    return y, rate


def peak_hz(y: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.argmax(spectrum) * rate / len(y))


def check(y: np.ndarray, rate: int, x: np.ndarray, name: str) -> None:
    seconds = len(y) / rate
    if name in ("wav", "flac", "pcm"):
        assert rate == SR
        expected = np.round(np.clip(x, -1, 1) * 32767) / 32767
        np.testing.assert_allclose(y, expected, atol=1.5 / 32767)
    else:
        # lossy codecs add encoder delay/padding (< 0.1 s) but keep length and pitch
        assert len(x) / SR <= seconds < len(x) / SR + 0.1
        assert abs(peak_hz(y, rate) - 440.0) < 5.0
        assert 0.3 < np.abs(y).max() < 0.7


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_stream_round_trip(name: str) -> None:
    x = tone()
    enc = StreamEncoder(name, SR)
    parts = [enc.write(x[i : i + 4000]) for i in range(0, len(x), 4000)]
    tail = enc.close()
    y, rate = decode(b"".join(parts) + tail, name)
    check(y, rate, x, name)
    if audio_format(name).streamable and name != "ogg":
        # audio leaves the encoder before the end (vorbis pages fill slowly; flac waits)
        assert sum(len(p) for p in parts) > 0


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_whole_and_file_round_trip(name: str, tmp_path) -> None:
    x = tone(0.8)
    check(*decode(encode(x, SR, name), name), x, name)
    path = tmp_path / f"out.{name}"
    assert write_stream(path, [x[:5000], x[5000:]], SR, name) == len(x)
    check(*decode(path.read_bytes(), name), x, name)


def test_opus_is_resampled_to_a_rate_opus_takes() -> None:
    y, rate = decode(encode(tone(), SR, "opus"), "opus")
    assert rate == 48000 and len(y) >= 1.5 * 48000


def test_wav_stream_header_says_unknown_length_and_pcm_has_none() -> None:
    enc = StreamEncoder("wav", SR)
    first = enc.write(tone(0.1))
    assert first[:4] == b"RIFF" and first[4:8] == b"\xff\xff\xff\xff"
    assert len(StreamEncoder("pcm", SR).write(tone(0.1))) == 2 * int(SR * 0.1)


def test_clipping_input_is_limited() -> None:
    y, _ = decode(encode(np.array([2.0, -3.0, 0.5], np.float32), SR, "pcm"), "pcm")
    np.testing.assert_allclose(y, [1.0, -1.0, 16384 / 32767], atol=1e-4)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_empty_audio_is_a_valid_file(name: str) -> None:
    y, rate = decode(encode(np.zeros(0, np.float32), SR, name), name)
    assert len(y) / rate < 0.1 and np.abs(y).max(initial=0.0) < 1e-3


def test_unsupported_formats_say_why() -> None:
    with pytest.raises(UnsupportedFormatError, match="no AAC encoder"):
        audio_format("aac")
    with pytest.raises(UnsupportedFormatError, match="unknown audio format"):
        audio_format("xyz")
    with pytest.raises(UnsupportedFormatError, match="no file suffix"):
        format_for_path("out")
    assert format_for_path("a/b.MP3").name == "mp3"
    assert format_for_path("a/b.wav", "flac").name == "flac"
