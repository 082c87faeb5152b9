"""POST /v1/audio/music: text (and optionally a melody or a clip to continue, base64 audio) to
music with MusicGen; JSON in, the audio file out.

The model is the server's one music model (`$LOCALLLM_MUSIC_MODEL`, else facebook/musicgen-small
from the Hugging Face cache), loaded on the first request in a worker thread. Generation runs in
a worker thread, one at a time: later requests wait their turn in arrival order, at most
`MAX_WAITING` of them (then 429), and a request whose client left while it waited is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from localllm.app.server.errors import APIError

router = APIRouter()
MAX_WAITING = 4  # requests queued behind the running generation


class MusicRequest(BaseModel):
    prompt: str
    model: str | None = None  # optional; must name the server's music model
    duration: float = 10.0
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = 250
    top_p: float = 1.0
    guidance_scale: float = 3.0
    response_format: str = "wav"
    melody: str | None = None  # base64 audio file (musicgen-melody models)
    audio: str | None = None  # base64 audio file to continue


class MusicService:
    """The lazily loaded model, and the lock generations take turns on."""

    def __init__(self, name: str):
        self.name = name
        self.model = None
        self.load_lock = asyncio.Lock()
        self.turn = asyncio.Lock()
        self.waiting = 0

    async def get(self):
        async with self.load_lock:
            if self.model is None:
                self.model = await asyncio.to_thread(self._load)
        return self.model

    def _load(self):
        from localllm.app.music import load_music_model

        try:
            return load_music_model(self.name)
        except (OSError, ValueError) as e:
            raise APIError(503, f"music generation is unavailable: {e}", code="no_model") from None


def _service(request: Request) -> MusicService:
    state = request.app.state
    service = getattr(state, "music", None)
    if service is None:  # per app, made on first use
        from localllm.app.music import default_music_model

        name = getattr(state, "music_model", None) or default_music_model()
        service = state.music = MusicService(str(name))
    return service


def _audio_bytes(text: str | None, field: str) -> bytes | None:
    if text is None:
        return None
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{field} must be base64-encoded audio", param=field) from None
    if not data:
        raise APIError(400, f"{field} is empty", param=field)
    return data


def _check(body: MusicRequest, service: MusicService):
    from localllm.app.music import sampling_options
    from localllm.media.audio.encode import UnsupportedFormatError, audio_format
    from localllm.media.music import check_seconds

    if not body.prompt.strip():
        raise APIError(400, "prompt must not be empty", param="prompt")
    names = {service.name, Path(service.name).name}
    if body.model is not None and body.model not in names:
        raise APIError(400, f"unknown music model {body.model!r}; this server has "
                       f"{service.name!r}", param="model", code="model_not_found")  # fmt: skip
    try:
        check_seconds(body.duration)
    except ValueError as e:
        raise APIError(400, str(e), param="duration") from None
    try:
        fmt = audio_format(body.response_format)
    except UnsupportedFormatError as e:
        raise APIError(400, str(e), param="response_format") from None
    try:
        opts = sampling_options(body.temperature, body.top_k, body.top_p, body.guidance_scale,
                                body.seed)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None
    return fmt, opts


def _generate(model, body: MusicRequest, opts, melody: bytes | None, clip: bytes | None):
    from localllm.app.music import read_inputs
    from localllm.media.audio import AudioError

    try:
        inputs = read_inputs(model, melody, clip)
    except AudioError as e:
        raise APIError(400, str(e), param="melody" if melody else "audio") from None
    except ValueError as e:  # not a melody model
        raise APIError(400, str(e), param="melody") from None
    try:
        return model.generate(body.prompt, body.duration, opts, inputs.melody, inputs.continuation)
    except ValueError as e:  # longer than the model can make, clip longer than the duration
        raise APIError(400, str(e), param="duration") from None


@router.post("/v1/audio/music")
async def music(body: MusicRequest, request: Request) -> Response:
    from localllm.media.music.clip import encode_music

    service = _service(request)
    fmt, opts = _check(body, service)
    melody, clip = _audio_bytes(body.melody, "melody"), _audio_bytes(body.audio, "audio")
    if service.waiting >= MAX_WAITING:
        raise APIError(429, f"busy: {MAX_WAITING} music requests are already waiting",
                       code="rate_limit_exceeded")  # fmt: skip
    service.waiting += 1
    started = False
    try:
        async with service.turn:
            service.waiting -= 1
            started = True
            if await request.is_disconnected():  # left while waiting: nobody to answer
                return Response(status_code=499)
            model = await service.get()
            result = await asyncio.to_thread(_generate, model, body, opts, melody, clip)
    finally:
        if not started:  # cancelled while waiting
            service.waiting -= 1
    data = await asyncio.to_thread(encode_music, result.samples, result.sample_rate, fmt)
    headers = {"X-Music-Seconds": f"{result.seconds:.3f}", "X-Music-Model": model.name}
    return Response(data, media_type=fmt.media_type, headers=headers)
