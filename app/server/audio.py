"""POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI multipart shapes), on Whisper.

The Whisper model loads on the first request, in a worker thread; decoding also runs in a
thread, one request at a time, so the event loop (and the text engine's streams) never stall.
Which model: `app.state.whisper_dir` (serve's --whisper), else the packaged default.
Beyond OpenAI's fields both endpoints take `beam_size` (1 to 16, default 5; 1 = greedy).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import PlainTextResponse, Response

from localllm.app.server.errors import APIError

if TYPE_CHECKING:  # imported lazily at run time: torch loads only when audio is asked for
    from localllm.media.stt import DecodeOptions, Transcript, WhisperBundle

router = APIRouter()
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


class SpeechToText:
    """A lazily loaded Whisper bundle and the lock that serialises its use."""

    def __init__(self, model_dir: str | Path | None):
        self.model_dir = model_dir
        self.bundle: WhisperBundle | None = None
        self.load_lock = asyncio.Lock()
        self.busy = asyncio.Lock()

    async def get(self) -> WhisperBundle:
        async with self.load_lock:
            if self.bundle is None:
                self.bundle = await asyncio.to_thread(self._load)
        return self.bundle

    def _load(self) -> WhisperBundle:
        from localllm.app.transcribe import pick_device, resolve_whisper
        from localllm.media.stt import load_whisper

        try:
            path = resolve_whisper(str(self.model_dir) if self.model_dir else None)
        except ValueError as e:
            raise APIError(503, f"speech to text is unavailable: {e}", code="no_model") from None
        return load_whisper(path, device=pick_device("auto"))


def _stt(request: Request) -> SpeechToText:
    state = request.app.state
    stt = getattr(state, "stt", None)
    if stt is None:  # per app, made on first use (the app's state, not module state)
        stt = state.stt = SpeechToText(getattr(state, "whisper_dir", None))
    return stt


def _run(bundle: WhisperBundle, data: bytes, opts: DecodeOptions) -> Transcript:
    from localllm.media.audio import load_audio
    from localllm.media.stt import transcribe

    return transcribe(bundle, load_audio(data), opts)


async def _handle(
    request: Request,
    task: str,
    file: UploadFile,
    language: str | None,
    prompt: str | None,
    response_format: str,
    temperature: float,
    granularities: list[str],
    beam_size: int,
) -> Response:
    from localllm.media.stt import DecodeOptions, render
    from localllm.media.stt.decoding import MAX_BEAM_SIZE
    from localllm.media.stt.formats import to_dict

    if response_format not in RESPONSE_FORMATS:
        choices = ", ".join(RESPONSE_FORMATS)
        raise APIError(400, f"response_format must be one of {choices}", param="response_format")
    unknown = sorted(set(granularities) - {"word", "segment"})
    if unknown:
        raise APIError(
            400,
            "timestamp_granularities takes word and/or segment",
            param="timestamp_granularities",
        )
    words = "word" in granularities
    if granularities and response_format != "verbose_json":
        raise APIError(
            400,
            "timestamp_granularities needs response_format=verbose_json",
            param="timestamp_granularities",
        )
    if not 0 <= temperature <= 1:
        raise APIError(400, "temperature must be between 0 and 1", param="temperature")
    if not 1 <= beam_size <= MAX_BEAM_SIZE:
        message = f"beam_size must be between 1 and {MAX_BEAM_SIZE}"
        raise APIError(400, message, param="beam_size")
    data = await file.read()
    if not data:
        raise APIError(400, "the uploaded file is empty", param="file")
    temps = (temperature,) if temperature > 0 else DecodeOptions().temperatures
    opts = DecodeOptions(
        task=task,
        language=language or None,
        temperatures=temps,
        beam_size=beam_size,
        initial_prompt=prompt or None,
        word_timestamps=words,
    )
    stt = _stt(request)
    bundle = await stt.get()
    async with stt.busy:
        result = await asyncio.to_thread(_run, bundle, data, opts)
    if response_format == "json":
        return Response(json.dumps({"text": result.text}), media_type="application/json")
    if response_format == "verbose_json":
        body = to_dict(result, task)
        if words and "segment" not in granularities:
            del body["segments"]  # as OpenAI: segments only when asked for (or by default)
        if words:
            body.setdefault("words", [])  # no speech: an empty list, not a missing key
        return Response(json.dumps(body), media_type="application/json")
    fmt = "text" if response_format == "text" else response_format
    return PlainTextResponse(render(result, fmt, task))


@router.post("/v1/audio/transcriptions")
async def transcriptions(
    request: Request,
    file: Annotated[UploadFile, File()],
    model: Annotated[str, Form()] = "whisper-1",
    language: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    timestamp_granularities: Annotated[list[str], Form(alias="timestamp_granularities[]")] = [],  # noqa: B006
    beam_size: Annotated[int, Form()] = 5,
) -> Response:
    # `model` is accepted and ignored: the server holds one speech-to-text model.
    # beam_size (ours, as faster-whisper's): beams at temperature 0, 1 to 16, 1 = greedy
    return await _handle(
        request, "transcribe", file, language, prompt, response_format, temperature,
        timestamp_granularities, beam_size,
    )  # fmt: skip


@router.post("/v1/audio/translations")
async def translations(
    request: Request,
    file: Annotated[UploadFile, File()],
    model: Annotated[str, Form()] = "whisper-1",
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    beam_size: Annotated[int, Form()] = 5,
) -> Response:
    return await _handle(
        request, "translate", file, None, prompt, response_format, temperature, [], beam_size
    )
