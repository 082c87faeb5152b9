"""POST /v1/audio/speech (OpenAI shape): text to speech with a Piper voice or a Kokoro model
(`voice` = one of its voice file names), streamed.

The voice loads on the first request, in a worker thread (serve's --tts, else the packaged
default). Each sentence is synthesized in a thread and its encoded bytes are sent at once, so the
first audio leaves before the whole text is done and the event loop never stalls. Sentences of
concurrent requests take turns on one lock (synthesis saturates the CPU either way).
`stream_format="sse"` sends `speech.audio.delta` events with base64 audio, then `speech.audio.done`.
"""

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from localllm.app.server.errors import APIError, error_body, to_api_error
from localllm.app.tts import OPENAI_VOICES

if TYPE_CHECKING:
    from localllm.media.tts.kokoro import KokoroTTS, KokoroVoice
    from localllm.media.tts.piper import PiperVoice

router = APIRouter()
MAX_INPUT_CHARS = 100_000  # OpenAI allows 4096; longer text is fine here, it streams


class SpeechRequest(BaseModel):
    model: str = "tts-1"  # accepted and ignored: the server holds one voice model
    input: str
    voice: str = "alloy"
    instructions: str | None = None  # not supported by Piper voices; ignored
    response_format: str = "mp3"
    speed: float = Field(default=1.0)
    stream_format: Literal["audio", "sse"] = "audio"


class TextToSpeech:
    """A lazily loaded voice and the lock its sentences take turns on."""

    def __init__(self, model: str | Path | None):
        self.model = model
        self.voice = None
        self.load_lock = asyncio.Lock()
        self.busy = asyncio.Lock()

    async def get(self):
        async with self.load_lock:
            if self.voice is None:
                self.voice = await asyncio.to_thread(self._load)
        return self.voice

    def _load(self):
        from localllm.media.tts.kokoro import is_kokoro_dir, load_kokoro
        from localllm.media.tts.piper import load_voice

        try:
            if self.model is not None and is_kokoro_dir(self.model):
                return load_kokoro(self.model)
            return load_voice(self.model)
        except (OSError, ValueError) as e:
            raise APIError(503, f"text to speech is unavailable: {e}", code="no_model") from None


def _tts(request: Request) -> TextToSpeech:
    state = request.app.state
    tts = getattr(state, "tts", None)
    if tts is None:  # per app, made on first use (the app's state, not module state)
        tts = state.tts = TextToSpeech(getattr(state, "tts_model", None))
    return tts


def _check(body: SpeechRequest):
    from localllm.media.audio.encode import UnsupportedFormatError, audio_format
    from localllm.media.tts.piper import check_speed

    if not body.input.strip():
        raise APIError(400, "input must not be empty", param="input")
    if len(body.input) > MAX_INPUT_CHARS:
        raise APIError(400, f"input is longer than {MAX_INPUT_CHARS} characters", param="input")
    try:
        fmt = audio_format(body.response_format)
    except UnsupportedFormatError as e:
        raise APIError(400, str(e), param="response_format") from None
    try:
        check_speed(body.speed)
    except ValueError as e:
        raise APIError(400, str(e), param="speed") from None
    return fmt


async def _audio(tts: TextToSpeech, voice, sentences, speed: float, fmt) -> AsyncIterator[bytes]:
    from localllm.media.audio.encode import StreamEncoder

    enc = StreamEncoder(fmt, voice.sample_rate)
    for sentence in sentences:
        async with tts.busy:
            chunk = await asyncio.to_thread(voice.render, sentence, speed)
        data = await asyncio.to_thread(enc.write, chunk.samples)
        if data:
            yield data
    tail = enc.close()
    if tail:
        yield tail


def _pick_voice(model: "PiperVoice | KokoroTTS", name: str) -> "PiperVoice | KokoroVoice":
    """The request's voice: a Kokoro model's voice by file name, or a Piper model's one voice.
    OpenAI's names and `default` map to the default voice."""
    from localllm.media.tts.kokoro import KokoroTTS

    if isinstance(model, KokoroTTS):
        try:
            return model.voice(None if name in ("default", *OPENAI_VOICES) else name)
        except ValueError as e:
            raise APIError(400, str(e), param="voice") from None
    if name not in ("default", model.name, *OPENAI_VOICES):
        raise APIError(
            400, f"unknown voice {name!r}; this server has {model.name!r}", param="voice"
        )
    return model


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(audio: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for data in audio:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except Exception as exc:  # headers are gone: the error is the last event
        e = to_api_error(exc)
        yield _event(error_body(e.status, e.message, e.param, e.code))
        return
    yield _event({"type": "speech.audio.done"})


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, request: Request) -> StreamingResponse:
    fmt = _check(body)
    tts = _tts(request)
    voice = await asyncio.to_thread(_pick_voice, await tts.get(), body.voice)
    sentences = await asyncio.to_thread(voice.sentences, body.input)
    audio = _audio(tts, voice, sentences, body.speed, fmt)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if body.stream_format == "sse":
        return StreamingResponse(_sse(audio), media_type="text/event-stream", headers=headers)
    return StreamingResponse(audio, media_type=fmt.media_type, headers=headers)
