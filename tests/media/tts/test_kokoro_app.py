"""Kokoro through the app: `localllm tts -m DIR --voice NAME` and POST /v1/audio/speech with a
Kokoro directory (the kind told from the directory), on a small random-weight model saved in the
released layout. The audio must equal the library's own output for the same text and seed."""

import asyncio
import io
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from localllm.app.cli import main
from localllm.app.server.app import create_app
from localllm.app.server.settings import ServerSettings
from localllm.media.tts.kokoro import KokoroConfig, KokoroModel, load_kokoro
from localllm.media.tts.kokoro.checkpoint import PARTS

SYMBOLS = ';:,.!?" AIOTWYabdefhijklmnopstuvwzæðŋɑɔəɛɜɡɪɹʃʊʌʒʤʧˈˌ'
CONFIG = {
    "vocab": {c: i + 1 for i, c in enumerate(SYMBOLS)},
    "n_token": 64,
    "hidden_dim": 512,
    "style_dim": 128,
    "n_layer": 1,
    "max_dur": 6,
    "text_encoder_kernel_size": 3,
    "plbert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 96, "num_hidden_layers": 1, "embedding_size": 16},
    "istftnet": {"upsample_kernel_sizes": [4], "upsample_rates": [2], "gen_istft_hop_size": 4,
                 "gen_istft_n_fft": 8, "resblock_kernel_sizes": [3],
                 "resblock_dilation_sizes": [[1, 3, 5]], "upsample_initial_channel": 512},
}  # fmt: skip
TEXT = "Hello there. How are you?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kokoro_app")
    torch.manual_seed(0)
    model = KokoroModel(KokoroConfig.from_dict(CONFIG))
    parts = {
        name: {f"module.{k}": v for k, v in getattr(model, name).state_dict().items()}
        for name in PARTS
    }
    torch.save(parts, root / "kokoro-v1_0.pth")
    (root / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    (root / "voices").mkdir()
    gen = torch.Generator().manual_seed(1)
    for name in ("af_heart", "bf_test"):
        torch.save(0.3 * torch.randn(510, 1, 256, generator=gen), root / "voices" / f"{name}.pt")
    return root


@pytest.fixture(scope="module")
def tts(model_dir):
    return load_kokoro(model_dir)


def test_cli_speaks_with_the_named_voice(model_dir, tts, tmp_path) -> None:
    out = tmp_path / "k.wav"
    argv = ["tts", "-m", str(model_dir), "--voice", "bf_test", TEXT, "-o", str(out)]
    assert main([*argv, "--seed", "1", "--format", "wav"]) == 0
    audio, rate = sf.read(out, dtype="float32")
    expected = tts.voice("bf_test").synthesize(TEXT, seed=1)
    assert rate == 24_000 and audio.shape == expected.shape and len(audio) > 0
    assert np.abs(audio - expected).max() < 2 / 32767  # 16-bit WAV quantization
    # OpenAI names (and no --voice) mean af_heart, a different voice
    alloy = tmp_path / "alloy.wav"
    argv = ["tts", "-m", str(model_dir), "--voice", "alloy", "Hi.", "-o", str(alloy)]
    assert main([*argv, "--seed", "1"]) == 0
    default = tts.voice("af_heart").synthesize("Hi.", seed=1)
    assert np.abs(sf.read(alloy, dtype="float32")[0] - default).max() < 2 / 32767


def test_cli_errors_are_one_line(model_dir, tmp_path, capsys) -> None:
    out = str(tmp_path / "x.wav")
    assert main(["tts", "-m", str(model_dir), "--voice", "zz_none", "hi", "-o", out]) == 1
    assert "unknown voice 'zz_none'; this model has: af_heart, bf_test" in capsys.readouterr().err
    assert main(["tts", "-m", str(tmp_path), "hi", "-o", out]) == 1
    assert "not a Kokoro directory" in capsys.readouterr().err


def _serve(model_dir):
    engine = SimpleNamespace(max_model_len=64, alive=True, tokenizer=None)
    app = create_app(engine, ServerSettings(model_id="m"))
    app.state.tts_model = str(model_dir)
    return app


def _post(app, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/audio/speech", json=body)

    return asyncio.run(go())


def test_server_speech_with_a_kokoro_voice(model_dir, tts) -> None:
    app = _serve(model_dir)
    r = _post(app, {"input": TEXT, "voice": "nope"})  # loads the model, then refuses the voice
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "voice" and "af_heart, bf_test" in err["message"]
    torch.manual_seed(5)  # the server does not seed: compare against the same global draws
    r = _post(app, {"input": TEXT, "voice": "bf_test", "response_format": "flac"})
    assert r.status_code == 200, r.text
    audio, rate = sf.read(io.BytesIO(r.content), dtype="float32")
    torch.manual_seed(5)
    expected = tts.voice("bf_test").synthesize(TEXT)
    assert rate == 24_000 and audio.shape == expected.shape
    assert np.abs(audio - expected).max() < 2 / 32767
