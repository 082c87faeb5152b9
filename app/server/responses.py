"""POST /v1/responses: OpenAI's Responses API, basic text (input, instructions, sampling, stream)
and images (`input_image` parts with an `image_url`: a data:, http(s): or allowed file: URL).

The input becomes chat messages and goes through the same preparation as chat completions. The
stream is the API's event sequence (created, in_progress, each output item's added / delta / done
events, completed), each with a sequence number. Reasoning (a `<think>` block, gpt-oss's analysis
channel) becomes a `reasoning` output item ahead of the message (`responses_items`).
"""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from localllm.app.server.chat_output import ChoiceOutput
from localllm.app.server.chat_prep import prepare_chat
from localllm.app.server.common import now, resolve_model
from localllm.app.server.errors import APIError
from localllm.app.server.responses_items import OutputItems, typed_id
from localllm.app.server.sse_events import Event, named_sse_response
from localllm.app.server.streams import collect, drive, unless_disconnected, with_first
from localllm.engine.core.outputs import Usage
from localllm.engine.sampling.params import SamplingParams

router = APIRouter()

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # store, metadata, ... are accepted and ignored

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False

    def messages(self) -> list[dict]:
        if (self.model_extra or {}).get("tools"):
            raise ValueError("tools are not supported on /v1/responses; use /v1/chat/completions")
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            if item.get("type", "message") != "message" or "role" not in item:
                raise ValueError(f"input items of type {item.get('type')!r} are not supported")
            role = "system" if item["role"] == "developer" else str(item["role"])
            out.append({"role": role, "content": _content(item.get("content"))})
        if not out:
            raise ValueError("input must not be empty")
        return out

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=self.max_output_tokens,
        )


def _content(content: Any) -> str | list[dict]:
    """A message's text, or its typed parts when it has images (the chat path's
    `{"type": "image", "url": URL}`, whose URL `chat_prep` takes out and loads)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("message content must be a string or a list of content parts")
    parts = [_part(p) for p in content]
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _part(part: Any) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "input_image":
        url = part.get("image_url")
        if isinstance(url, dict):  # the chat API's shape, taken here too
            url = url.get("url")
        if not isinstance(url, str) or not url:
            if part.get("file_id"):
                raise ValueError("input_image by file_id is not supported (no Files API): "
                                 "send image_url, a data: or http(s) URL")  # fmt: skip
            raise ValueError("an input_image part needs image_url (a data: or http(s) URL)")
        return {"type": "image", "url": url}
    raise ValueError(
        f"content parts of type {kind!r} are not supported on /v1/responses "
        "(supported: input_text, output_text, input_image)"
    )


def _usage(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


class _Shape:
    """The response object at each stage of one request."""

    def __init__(self, body: ResponsesRequest, params: SamplingParams, model: str):
        self.id, self.created = typed_id("resp"), now()
        self.body, self.params, self.model = body, params, model

    def response(self, status: str, output: list[dict], usage: Usage | None = None,
                 finish: str | None = None) -> dict:  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": False,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": {},
            "usage": None if usage is None else _usage(usage),
        }


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    settings = request.app.state.settings
    prep = await prepare_chat(engine, settings, body.messages(), body.sampling_params())
    shape = _Shape(body, prep.params, model)
    stream = prep.stream(engine, shape.id)
    co = ChoiceOutput(prep.plan)
    if not body.stream:
        done = await unless_disconnected(request, collect(request, stream, 1))
        c = done.completions[0]
        items = OutputItems(lambda kind, **data: (kind, data))
        for d in co.feed(c.text) + co.finish():
            items.add(d)
        output = items.output("completed")
        return JSONResponse(shape.response("completed", output, done.last.usage, c.finish_reason))

    outs = drive(request, stream)
    first = await anext(outs)  # a bad request fails here, as a plain 400 before any event
    seq = iter(range(1 << 62))

    def ev(kind: str, **data) -> Event:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    async def events() -> AsyncIterator[Event]:
        items = OutputItems(ev)
        try:
            yield ev("response.created", response=shape.response("in_progress", []))
            yield ev("response.in_progress", response=shape.response("in_progress", []))
            last, finish = first, None
            async for out in with_first(first, outs):
                last = out
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                for c in out.outputs:
                    deltas = co.feed(c.text) + (co.finish() if c.finish_reason else [])
                    finish = c.finish_reason or finish
                    for d in deltas:
                        for e in items.add(d):
                            yield e
            for e in items.close():
                yield e
            final = shape.response("completed", items.output("completed"), last.usage, finish)
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            yield ev(kind, response=final)
        finally:
            await outs.aclose()

    def on_error(e: APIError) -> Event:
        return ev("error", code=e.code, message=e.message, param=e.param)

    return named_sse_response(events(), on_error)
