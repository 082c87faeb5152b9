"""POST /infill: fill-in-the-middle in llama-server's shape (editors such as llama.vscode use it).

Request: `input_prefix`, `input_suffix`, `input_extra` ([{filename, text}]), `prompt` (text
after the prefix), `n_predict`, the sampling fields, `stream`. Response: `content`, `stop`,
`stop_type`, `tokens_predicted`, `tokens_evaluated`, ...; streamed as `data:` events without
`[DONE]`, as llama-server does. `fim_ids` is shared with /v1/completions' `suffix`.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from localllm.app.server.common import new_id, resolve_model
from localllm.app.server.errors import APIError, error_body, to_api_error
from localllm.app.server.protocol import SamplingFields
from localllm.app.server.streams import collect, drive, unless_disconnected, with_first
from localllm.engine.core.outputs import RequestOutput
from localllm.engine.fim import FimChunk, fim_prompt, fim_tokens_for

router = APIRouter()


class InfillChunk(BaseModel):
    filename: str = "tmp"
    text: str  # required, as llama-server has it: an empty chunk is a client's mistake


class InfillRequest(SamplingFields):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = None  # llama-server's max_tokens; -1: until the end

    def to_sampling_params(self):
        if self.n != 1:
            raise ValueError("/infill makes one completion (n must be 1)")
        n_predict = self.n_predict if self.n_predict is not None and self.n_predict >= 0 else None
        return self.sampling_params(
            max_tokens=self.max_tokens if self.max_tokens is not None else n_predict,
            structured=self.structured(None),  # llama-server's `grammar` / `json_schema`
        )


async def fim_ids(
    engine: Any,
    model: str,
    prefix: str,
    suffix: str,
    *,
    prompt: str = "",
    extra: Sequence[FimChunk] = (),
    max_tokens: int | None = None,
) -> list[int]:
    """The PSM prompt ids for `engine`'s model; 400 when it has no FIM tokens. The prefix and
    suffix are cut to leave room for `max_tokens` (a quarter of the context when unset)."""
    core = engine.engine
    fim = fim_tokens_for(core.gguf.metadata, engine.tokenizer)
    if fim is None:
        raise APIError(
            400,
            f"the model {model!r} has no fill-in-the-middle tokens (no tokenizer.ggml.fim_* "
            "metadata and no <fim_prefix>/<|fim_prefix|>/<PRE>-style tokens)",
            param="suffix",
            code="fim_unsupported",
        )
    ctx = engine.max_model_len
    room = ctx - (max_tokens if max_tokens is not None else ctx // 4)
    return await asyncio.to_thread(
        fim_prompt, engine.tokenizer, fim, prefix, suffix, prompt=prompt, extra=extra,
        max_tokens=max(room, 1),
    )  # fmt: skip


def _stop_type(reason: str | None, stop_reason: int | str | None) -> str:
    if reason == "length":
        return "limit"
    if reason == "stop":
        return "word" if isinstance(stop_reason, str) else "eos"
    return "none"


def _final(model: str, last: RequestOutput, text: str, reason, stop_reason) -> dict:
    u = last.usage
    return {
        "index": 0,
        "content": text,
        "id_slot": 0,
        "stop": True,
        "model": model,
        "tokens_predicted": u.completion_tokens,
        "tokens_evaluated": u.prompt_tokens,
        "tokens_cached": u.cached_tokens,
        "stop_type": _stop_type(reason, stop_reason),
        "stopping_word": stop_reason if isinstance(stop_reason, str) else "",
        "truncated": False,
        "has_new_line": "\n" in text,
    }


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@router.post("/infill")
async def infill(body: InfillRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    params = body.to_sampling_params()
    extra = [FimChunk(c.filename, c.text) for c in body.input_extra]
    ids = await fim_ids(
        engine, model, body.input_prefix, body.input_suffix, prompt=body.prompt, extra=extra,
        max_tokens=params.max_tokens,
    )  # fmt: skip
    stream = engine.generate(ids, params, new_id("infill"), cache_salt=body.cache_salt)
    if not body.stream:
        done = await unless_disconnected(request, collect(request, stream, 1))
        c = done.completions[0]
        final = _final(model, done.last, c.text, c.finish_reason, c.stop_reason)
        return JSONResponse({**final, "tokens": c.token_ids})
    outs = drive(request, stream)
    first = await anext(outs)  # a bad request fails here, as a plain 400 before any event

    async def events() -> AsyncIterator[bytes]:
        text, reason, stop_reason, last = "", None, None, first
        try:
            async for out in with_first(first, outs):
                last = out
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                for c in out.outputs:
                    text += c.text
                    reason, stop_reason = c.finish_reason or reason, c.stop_reason or stop_reason
                    if c.text:
                        yield _event({"index": 0, "content": c.text, "tokens": c.token_ids,
                                      "stop": False, "id_slot": 0})  # fmt: skip
            final = _final(model, last, "", reason, stop_reason)
            yield _event({**final, "tokens": [], "has_new_line": "\n" in text})
        except Exception as exc:  # headers are sent: the error is the last event
            e = to_api_error(exc)
            yield _event(error_body(e.status, e.message, e.param, e.code))
        finally:
            await outs.aclose()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
