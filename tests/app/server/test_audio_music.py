"""POST /v1/audio/music on a real `localllm serve` over a real socket, with the tiny recorded
MusicGen-Melody as the server's music model: greedy results equal transformers' codes decoded
(with and without a base64 melody), compressed formats decode, concurrent requests are served
in turn, seeded requests repeat, and bad input is a 400 naming the field."""

from __future__ import annotations

import base64
import concurrent.futures
import io

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from tests.app.server.conftest import serve_process
from tests.media.music.music_fixture import DATA, MELODY_WAV, expected, model

MELODY_MODEL = DATA / "musicgen-melody"
SECONDS = expected()["frames"] / 50


@pytest.fixture(scope="module")
def music_server(smollm2_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_MUSIC_MODEL", "/nonexistent")  # --music below takes precedence
        mp.setenv("LOCALLLM_MUSIC_DTYPE", "float32")  # the precision transformers ran in
        mp.setenv("OMP_NUM_THREADS", "1")  # tiny ops: a busy second core only adds waiting
        with serve_process(["-m", str(smollm2_path), "--ctx-size", "512",
                            "--music", str(MELODY_MODEL)],
                           tmp_path_factory.mktemp("serve-music")) as (base, _):  # fmt: skip
            yield base


def _post(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/audio/music", json=body, timeout=120)


def _expected_pcm16(case: str) -> np.ndarray:
    wave = model("musicgen-melody").decode(torch.tensor(expected()["cases"][case]["codes"]))
    return np.round(np.clip(wave[0], -1, 1) * 32767).astype(np.int16)


def test_greedy_with_and_without_melody_equals_transformers(music_server):
    r = _post(music_server, prompt=expected()["prompt"], duration=SECONDS, temperature=0)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    assert float(r.headers["x-music-seconds"]) == pytest.approx(SECONDS)
    audio, rate = sf.read(io.BytesIO(r.content), dtype="int16")
    assert rate == 32000
    np.testing.assert_allclose(audio, _expected_pcm16("melody_none_cfg3"), atol=2)
    melody = base64.b64encode(MELODY_WAV.read_bytes()).decode()
    r = _post(music_server, prompt=expected()["prompt"], duration=SECONDS, temperature=0,
              melody=melody, model="musicgen-melody")  # fmt: skip
    assert r.status_code == 200, r.text
    audio, _ = sf.read(io.BytesIO(r.content), dtype="int16")
    np.testing.assert_allclose(audio, _expected_pcm16("melody_cfg3"), atol=2)


@pytest.mark.parametrize("fmt,container", [("mp3", "MP3"), ("flac", "FLAC"), ("ogg", "OGG")])
def test_formats(music_server, fmt, container):
    r = _post(music_server, prompt="synth", duration=0.3, seed=1, response_format=fmt)
    assert r.status_code == 200, r.text
    assert sf.info(io.BytesIO(r.content)).format == container


def test_longer_than_the_models_positions_is_made_in_windows(music_server):
    """Past the position table (the tiny model's is a few seconds) the server extends in windows,
    as audiocraft does (`media/music/extend.py`), instead of refusing."""
    r = _post(music_server, prompt="a", duration=60, seed=3, top_k=20)
    assert r.status_code == 200, r.text
    info = sf.info(io.BytesIO(r.content))
    assert abs(info.frames / info.samplerate - 60) < 0.1, info.duration


def test_concurrent_requests_take_turns_and_seeds_repeat(music_server):
    body = {"prompt": "lofi", "duration": 0.4, "seed": 9, "top_k": 20}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: _post(music_server, **body), range(3)))
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].content == answers[1].content == answers[2].content
    other = _post(music_server, **{**body, "seed": 10})
    assert other.content != answers[0].content


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "  "}, "prompt"),
        ({"prompt": "a", "duration": 0}, "duration"),
        ({"prompt": "a", "duration": 600}, "duration"),
        ({"prompt": "a", "response_format": "aac"}, "response_format"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "model": "facebook/musicgen-large"}, "model"),
        ({"prompt": "a", "melody": "%%% not base64"}, "melody"),
        ({"prompt": "a", "melody": base64.b64encode(b"not audio at all").decode()}, "melody"),
    ],
)
def test_bad_input_is_400_naming_the_field(music_server, body, param):
    r = _post(music_server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
