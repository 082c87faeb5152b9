"""What each window is prompted with, against faster-whisper on the same Whisper base weights and
espeak-ng speech: the user's initial prompt reaches the first window, and a later window's prompt
(the text so far) keeps its timestamp tokens, as openai-whisper and faster-whisper keep them.
Both engines run their defaults (beam 5)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import soxr

from localllm.media.stt import DecodeOptions, load_whisper, transcribe

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)

faster_whisper = pytest.importorskip("faster_whisper")


def _speech(text: str) -> np.ndarray:
    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")
    audio, sr = clips.synthesize(text)
    return soxr.resample(audio, sr, 16_000).astype(np.float32)


@pytest.fixture(scope="module")
def base(whisper_base):
    return load_whisper(whisper_base)


@pytest.fixture(scope="module")
def faster(whisper_base):
    return faster_whisper.WhisperModel(
        str(whisper_base), device="cpu", compute_type="float32", cpu_threads=2
    )


def _theirs(faster, audio: np.ndarray, **kw) -> list:
    return list(faster.transcribe(audio, language="en", vad_filter=False, **kw)[0])


def test_initial_prompt_reaches_the_first_window_as_faster_whispers(base, faster):
    # one sentence padded to a whole window: the two front ends then see the same samples
    audio = _speech(clips.SENTENCES[0])
    audio = np.pad(audio, (0, base.mel.n_samples - len(audio)))
    prompt = "The weather today."
    plain = transcribe(base, audio)
    prompted = transcribe(base, audio, DecodeOptions(initial_prompt=prompt))
    theirs = _theirs(faster, audio, initial_prompt=prompt)
    assert [s.tokens for s in prompted.segments] == [tuple(s.tokens) for s in theirs]
    # the prompt changed the reading (measured: "but weather was" without it, "The weather was"
    # with it, on both engines)
    assert [s.tokens for s in plain.segments] != [s.tokens for s in prompted.segments]
    assert clips.word_error_rate(clips.SENTENCES[0], prompted.text) == 0, prompted.text


def test_later_windows_cut_segments_as_faster_whispers(base, faster):
    # five sentences after 3-9 s of faint noise each (45 s): the second window is prompted
    # with the first one's text. Prompted with bare text (no timestamps), it answered bare text:
    # one segment over the last two sentences.
    rng = np.random.default_rng(0)
    texts = clips.LONG[12:17]
    parts = []
    for text in texts:
        noise = rng.normal(0, 0.003, int(16_000 * rng.uniform(3, 9))).astype(np.float32)
        parts += [noise, _speech(text)]
    audio = np.concatenate(parts)
    ours = transcribe(base, audio)
    theirs = _theirs(faster, audio)
    assert len({s.seek for s in ours.segments}) == 2  # two windows
    assert [s.seek for s in ours.segments] == [s.seek for s in theirs]
    assert [s.text for s in ours.segments] == [s.text for s in theirs]
    for text, segment in zip(texts, ours.segments, strict=True):  # a sentence a segment
        assert clips.word_error_rate(text, segment.text) <= 1 / 8, segment.text
