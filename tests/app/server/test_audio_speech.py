"""POST /v1/audio/speech over a real socket with the official `openai` client: every response
format decodes back with soundfile, SSE sends one delta per sentence, a long text streams, and bad
input is a 400 with OpenAI's error shape."""

import base64
import io
import json

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.media.tts_fixtures import voice_path

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_voice():
    voice_path()


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":  # OpenAI's pcm: 24 kHz in their API; ours is the voice's rate, s16le
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, 22050
    return sf.read(io.BytesIO(data), dtype="float32")


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "wav", "pcm"])
def test_openai_client_speech_formats(server, fmt: str) -> None:
    client = server.openai()
    response = client.audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the server.", response_format=fmt
    )
    audio, rate = decode(response.content, fmt)
    assert rate == (48000 if fmt == "opus" else 22050)
    seconds = len(audio) / rate
    assert 0.6 < seconds < 4.0
    assert 0.02 < np.abs(audio).max() < 0.99


def test_streaming_response_and_speed(server) -> None:
    client = server.openai()
    text = "Streaming speech works. It comes sentence by sentence."
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="default", input=text, response_format="wav", speed=1.0
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        data = b"".join(response.iter_bytes())
    normal = decode(data, "wav")[0]
    fast = client.audio.speech.create(
        model="tts-1", voice="alloy", input=text, response_format="wav", speed=2.0
    )
    assert len(decode(fast.content, "wav")[0]) < 0.7 * len(normal)


def _sse_events(raw: bytes) -> list[dict]:
    return [
        json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: ")
    ]


def test_sse_one_delta_per_sentence(server) -> None:
    with server.http() as http:
        body = {"model": "tts-1", "voice": "alloy", "input": "One. Two. Three.",
                "response_format": "pcm", "stream_format": "sse"}  # fmt: skip
        r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.content)
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:3])
    audio = np.frombuffer(pcm, "<i2")
    assert len(audio) > 22050 // 2 and np.abs(audio).max() > 500


def test_long_text_streams_before_it_is_done(server) -> None:
    sentences = [f"This is sentence number {i} of a long text." for i in range(200)]
    body = {"model": "tts-1", "voice": "alloy", "input": " ".join(sentences),
            "response_format": "pcm", "stream_format": "sse"}  # fmt: skip
    with server.http() as http, http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        # the first sentence arrives on its own; we leave without waiting for the other 199
        event = json.loads(first[6:])
        assert event["type"] == "speech.audio.delta"
        seconds = len(base64.b64decode(event["audio"])) / 2 / 22050
        assert 1.0 < seconds < 6.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "input must not be empty"),
        ({"input": "   \n"}, "input must not be empty"),
        ({"input": "hi", "response_format": "aac"}, "no AAC encoder"),
        ({"input": "hi", "speed": 10}, "speed must be between"),
        ({"input": "hi", "voice": "nobody"}, "unknown voice"),
    ],
)
def test_bad_requests_are_400(server, body, message) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(**{"model": "tts-1", "voice": "alloy", **body})
    assert message in info.value.message


def test_missing_input_and_bad_json_are_400(server) -> None:
    with server.http() as http:
        r = http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = http.post(
            "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_emoji_only_input_is_audio_not_a_crash(server) -> None:
    response = server.openai().audio.speech.create(
        model="tts-1", voice="alloy", input="🎉🎉", response_format="wav"
    )
    audio, rate = decode(response.content, "wav")
    assert rate == 22050 and np.abs(audio).max(initial=0.0) < 0.99


def _app(tts_model):
    from fastapi import FastAPI

    from localllm.app.server import speech
    from localllm.app.server.errors import install_error_handlers

    app = FastAPI()
    app.include_router(speech.router)
    install_error_handlers(app)
    app.state.tts_model = tts_model  # what `serve --tts MODEL` sets
    return app


def _post(app, body: dict):
    import asyncio

    import httpx

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=600) as c:
            return await c.post("/v1/audio/speech", json=body)

    return asyncio.run(go())


def test_serve_tts_flag_picks_the_voice(tmp_path) -> None:
    body = {"model": "tts-1", "voice": "en_US-joe-medium", "input": "Hi.", "response_format": "wav"}
    r = _post(_app(str(voice_path())), body)
    assert r.status_code == 200
    assert decode(r.content, "wav")[1] == 22050
    r = _post(_app(str(tmp_path / "missing.onnx")), body)
    assert r.status_code == 503
    assert "text to speech is unavailable" in r.json()["error"]["message"]
