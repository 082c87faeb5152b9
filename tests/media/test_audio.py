"""Audio I/O and the log-mel front end: decoding every container, mixdown, resampling, streaming
with bounded memory, chunking, bad inputs; log-mel against transformers and a hand-computed case."""

import io
import tracemalloc

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch

from localllm.media.audio import (
    AudioError,
    MelSpec,
    SeekBuffer,
    Span,
    audio_info,
    chunk_spans,
    load_audio,
    log_mel,
    mel_filters,
    stream_audio,
)
from localllm.media.audio.mel import _hz_to_mel, _mel_to_hz


def _tone(freq: float, seconds: float, sr: int) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * sr / len(x))


@pytest.mark.parametrize(
    ("fmt", "subtype", "ext"),
    [("WAV", "PCM_16", "wav"), ("FLAC", "PCM_16", "flac"), ("OGG", "VORBIS", "ogg"),
     ("MP3", "MPEG_LAYER_III", "mp3")],
)  # fmt: skip
def test_decode_each_container_to_16k_mono(tmp_path, fmt, subtype, ext):
    sr = 44_100
    left, right = _tone(440, 1.0, sr), _tone(1000, 1.0, sr)
    path = tmp_path / f"a.{ext}"
    sf.write(path, np.stack([left, right], axis=1), sr, format=fmt, subtype=subtype)
    info = audio_info(path)
    assert (info.sample_rate, info.channels) == (sr, 2)
    out = load_audio(path)
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(len(out) - 16_000) < 1200  # mp3 adds encoder delay/padding
    assert 0.3 < np.abs(out).max() <= 0.6  # the mean of the two channels, not one of them
    if fmt in ("WAV", "FLAC"):  # lossless: compare with the mixdown resampled by soxr directly
        want = soxr.resample((left + right) / 2, sr, 16_000)
        np.testing.assert_allclose(out, want, atol=2e-4)


def test_resampling_keeps_the_pitch():
    buf = io.BytesIO()
    sf.write(buf, _tone(1234.0, 2.0, 22_050), 22_050, format="WAV")
    out = load_audio(buf.getvalue())
    assert len(out) == 32_000
    assert abs(_peak_hz(out, 16_000) - 1234.0) < 2.0


def test_stream_blocks_equal_the_whole(tmp_path):
    x = np.random.default_rng(1).standard_normal(48_000 * 7).astype(np.float32) * 0.1
    path = tmp_path / "n.flac"
    sf.write(path, x, 48_000, subtype="PCM_24")
    blocks = list(stream_audio(path, block_seconds=2.0))
    assert len(blocks) >= 3 and max(len(b) for b in blocks) <= 2 * 16_000 + 64
    whole = load_audio(path)
    np.testing.assert_allclose(np.concatenate(blocks), whole, atol=1e-5)
    np.testing.assert_allclose(whole, soxr.resample(x, 48_000, 16_000), atol=1e-3)


def test_two_hour_file_streams_in_bounded_memory(tmp_path):
    path = tmp_path / "two_hours.flac"
    sr, seconds = 16_000, 2 * 3600
    with sf.SoundFile(path, "w", sr, 1, format="FLAC", subtype="PCM_16") as f:
        block = (_tone(300, 60.0, sr) * 0.1).astype(np.float32)
        for _ in range(seconds // 60):
            f.write(block)
    assert audio_info(path).duration == seconds
    buf = SeekBuffer(stream_audio(path, block_seconds=30.0))
    tracemalloc.start()
    seek, windows = 0, 0
    while buf.has_data(seek):
        window = buf.window(seek, 480_000)
        seek += len(window) - 16_000  # overlap one second, as a chunked reader would
        windows += 1
        if len(window) < 480_000:
            break
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert buf.total == seconds * sr and windows == 249
    # the whole file as float32 is 460 MB; a window plus a block or two is a few MB
    assert peak < 20e6


def test_seek_buffer_windows_and_no_going_back():
    blocks = [np.arange(i, i + 10, dtype=np.float32) for i in range(0, 50, 10)]
    buf = SeekBuffer(blocks)
    np.testing.assert_array_equal(buf.window(5, 12), np.arange(5, 17))
    np.testing.assert_array_equal(buf.window(40, 100), np.arange(40, 50))
    assert buf.exhausted and buf.total == 50 and not buf.has_data(50)
    with pytest.raises(ValueError, match="backwards"):
        buf.window(3, 4)


def test_chunk_spans_with_overlap():
    assert chunk_spans(25, 10, 2) == [Span(0, 10), Span(8, 18), Span(16, 25)]
    assert chunk_spans(10, 10) == [Span(0, 10)]
    assert chunk_spans(0, 10) == []
    with pytest.raises(ValueError):
        chunk_spans(10, 10, 10)


def test_bad_inputs(tmp_path):
    with pytest.raises(AudioError, match="empty"):
        load_audio(b"")
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AudioError, match="empty"):
        load_audio(empty)
    with pytest.raises(AudioError, match="no such"):
        load_audio(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="not a readable audio"):
        load_audio(b"hello, this is plainly a text file\n" * 20)
    buf = io.BytesIO()
    sf.write(buf, np.zeros(0, dtype=np.float32), 16_000, format="WAV")
    with pytest.raises(AudioError, match="0 seconds"):
        load_audio(buf.getvalue())
    buf = io.BytesIO()
    sf.write(buf, _tone(440, 1.0, 16_000), 16_000, format="WAV", subtype="PCM_16")
    wav = buf.getvalue()
    with pytest.raises(AudioError):
        load_audio(wav[:30])  # cut inside the header
    half = load_audio(wav[: 44 + 16_000])  # header says 1 s, data holds 0.5 s: decode what is there
    assert len(half) == 8_000
    np.testing.assert_allclose(half, _tone(440, 1.0, 16_000)[:8000], atol=1e-4)


# ---- log-mel ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filters_and_log_mel_match_transformers(n_mels):
    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    spec = MelSpec(n_mels=n_mels)
    np.testing.assert_allclose(mel_filters(spec), fe.mel_filters.T, atol=1e-7)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(16_000 * 7) * 0.1 + _tone(500, 7.0, 16_000)).astype(np.float32)
    want = fe(x, sampling_rate=16_000, return_tensors="np").input_features[0]
    got = log_mel(x, spec, pad_to=spec.n_samples).numpy()
    assert got.shape == (n_mels, 3000) and want.std() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_slaney_scale_by_hand():
    # linear below 1 kHz (3 mels per 200 Hz), 27 steps per factor 6.4 above it
    assert _hz_to_mel(np.array(1000.0)) == pytest.approx(15.0)
    assert _hz_to_mel(np.array(6400.0)) == pytest.approx(42.0)
    assert _hz_to_mel(np.array(200.0)) == pytest.approx(3.0)
    np.testing.assert_allclose(_mel_to_hz(_hz_to_mel(np.array([50.0, 999.0, 7000.0]))),
                               [50.0, 999.0, 7000.0])  # fmt: skip


def test_log_mel_hand_computed():
    spec = MelSpec()
    # silence: every mel energy is floored to 1e-10, so each value is (log10(1e-10) + 4) / 4
    silent = log_mel(np.zeros(1600, dtype=np.float32), spec)
    assert silent.shape == (80, 10)
    assert torch.all(silent == -1.5)
    # a 1 s tone, by numpy from the definition: reflect-padded frames, periodic Hann, |rfft|^2
    x = _tone(1000.0, 1.0, 16_000).astype(np.float64)
    pad = np.pad(x, 200, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)
    frames = np.stack([pad[i * 160 : i * 160 + 400] * window for i in range(100)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    mel = np.log10(np.maximum(power @ mel_filters(spec).T.astype(np.float64), 1e-10)).T
    want = (np.maximum(mel, mel.max() - 8.0) + 4.0) / 4.0
    np.testing.assert_allclose(log_mel(x.astype(np.float32), spec).numpy(), want, atol=1e-4)
