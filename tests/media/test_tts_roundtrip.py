"""Round trip: 10 sentences spoken by our Piper port, transcribed by our Whisper (base when its
packages are installed, else tiny.en), must come back with a word error rate under 10 %."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import soxr

from localllm.media.stt import DecodeOptions, load_whisper, transcribe
from localllm.media.stt.packaged import default_model_dir
from tests.media.tts_fixtures import load_default_voice

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)

pytestmark = pytest.mark.slow


def test_tts_then_whisper_word_error_rate(tmp_path) -> None:
    voice = load_default_voice()
    model_dir = default_model_dir(tmp_path)
    if model_dir is None:
        pytest.skip("no packaged Whisper (see packaging/test-models.txt)")
    text = " ".join(clips.SENTENCES[:10])
    audio = voice.synthesize(text, seed=0)
    assert abs(len(audio) / voice.sample_rate - 30) < 15  # ~3 s a sentence
    speech = soxr.resample(audio, voice.sample_rate, 16_000).astype(np.float32)
    result = transcribe(load_whisper(model_dir), speech, DecodeOptions(language="en"))
    wer = clips.word_error_rate(text, result.text)
    print(f"TTS -> Whisper ({model_dir.name}) WER {wer:.3f}: {result.text}")
    assert wer < 0.10, (wer, result.text)
