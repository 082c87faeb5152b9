"""Audio from the real Piper voice: valid (22.05 kHz, no clipping, not silence, plausible length),
streamed one chunk per sentence, reproducible by seed, speed honoured; bad voice files fail
clearly."""

import json
import shutil

import numpy as np
import pytest

from localllm.media.tts.onnx_weights import VoiceFormatError
from localllm.media.tts.piper import PiperVoice
from tests.media.tts_fixtures import load_default_voice, voice_path, word_count

pytestmark = pytest.mark.slow
TEXT = "The weather is nice today. We will walk to the park."


@pytest.fixture(scope="module")
def voice() -> PiperVoice:
    return load_default_voice()


@pytest.fixture(scope="module")
def chunks(voice):
    return list(voice.stream(TEXT, seed=3))


def test_audio_is_valid_speech(voice, chunks) -> None:
    assert voice.sample_rate == 22050
    audio = np.concatenate([c.samples for c in chunks])
    assert audio.dtype == np.float32
    seconds = len(audio) / voice.sample_rate
    words_per_second = word_count(TEXT) / seconds
    assert 1.5 < words_per_second < 5.0, seconds  # people speak ~2.5-3 words/s
    assert np.abs(audio).max() < 0.99  # no clipping
    assert np.sqrt(np.mean(audio**2)) > 0.02  # not silence
    # speech has pauses: the quietest 50 ms windows are much quieter than the loudest
    frames = audio[: len(audio) // 1102 * 1102].reshape(-1, 1102)
    rms = np.sqrt((frames**2).mean(axis=1))
    assert rms.min() < 0.1 * rms.max()


def test_streams_one_chunk_per_sentence(voice, chunks) -> None:
    assert len(chunks) == 2
    assert chunks[0].phonemes.endswith(".") and chunks[1].phonemes.endswith(".")
    # the same seed gives the same audio, whole or streamed
    whole = voice.synthesize(TEXT, seed=3)
    np.testing.assert_array_equal(whole, np.concatenate([c.samples for c in chunks]))
    short = "Seeds matter."
    assert not np.array_equal(voice.synthesize(short, seed=1), voice.synthesize(short, seed=2))


def test_speed_maps_to_length_scale(voice) -> None:
    text = "Speaking faster makes shorter audio."
    slow = voice.synthesize(text, speed=1.0, seed=5)
    fast = voice.synthesize(text, speed=2.0, seed=5)
    assert 0.4 < len(fast) / len(slow) < 0.65
    assert voice.scales(2.0).length_scale == voice.config.scales.length_scale / 2
    with pytest.raises(ValueError, match="speed"):
        voice.scales(0.0)


def test_nothing_to_say_gives_no_audio_and_emoji_do_not_crash(voice) -> None:
    assert len(voice.synthesize("  ...  ")) == 0
    out = voice.synthesize("🙂", seed=1)  # espeak names the emoji; either way no crash
    assert out.dtype == np.float32 and np.abs(out).max(initial=0.0) < 0.99


def test_bad_voice_files(tmp_path) -> None:
    src = voice_path()
    with pytest.raises(FileNotFoundError):
        PiperVoice.load(tmp_path / "missing.onnx")
    alone = tmp_path / "alone.onnx"
    alone.write_bytes(b"\x08\x01")
    with pytest.raises(FileNotFoundError, match="voice config"):
        PiperVoice.load(alone)
    truncated = tmp_path / "cut.onnx"
    truncated.write_bytes(src.read_bytes()[:100_000])
    shutil.copy(f"{src}.json", f"{truncated}.json")
    with pytest.raises(VoiceFormatError):
        PiperVoice.load(truncated)
    bad_json = tmp_path / "badjson.onnx"
    bad_json.write_bytes(b"")
    (tmp_path / "badjson.onnx.json").write_text(json.dumps({"audio": {}}))
    with pytest.raises(VoiceFormatError, match="not a Piper voice config"):
        PiperVoice.load(bad_json)
