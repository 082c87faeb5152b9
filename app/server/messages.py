"""POST /v1/messages: Anthropic's Messages API, basic text (system, messages, sampling, stream).

Messages go through the same chat preparation as OpenAI chat. The answer is a list of content
blocks: a `<think>` block becomes a `thinking` block ahead of the `text` block. The stream is
Anthropic's event sequence: message_start, content_block_start, ping, content_block_delta...,
content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from localllm.app.server.chat_output import ChoiceOutput
from localllm.app.server.chat_prep import prepare_chat
from localllm.app.server.common import new_id, resolve_model
from localllm.app.server.errors import APIError
from localllm.app.server.sse_events import Event, named_sse_response
from localllm.app.server.streams import collect, drive, unless_disconnected, with_first
from localllm.engine.sampling_params import SamplingParams

router = APIRouter()

# Anthropic's error types by status, for errors inside a stream.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "timeout_error", 413: "request_too_large"}  # fmt: skip


class AnthropicMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ... accepted, ignored

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False

    def chat_messages(self) -> list[dict]:
        if (self.model_extra or {}).get("tools"):
            raise ValueError("tools are not supported on /v1/messages; use /v1/chat/completions")
        out = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system)})
        for m in self.messages:
            if m.role not in ("user", "assistant"):
                raise ValueError(f"messages: role must be 'user' or 'assistant', not {m.role!r}")
            out.append({"role": m.role, "content": _text(m.content)})
        return out

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences or ()),
            max_tokens=self.max_tokens,
        )


def _text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValueError("only text content blocks are supported")
        texts.append(block["text"])
    return "".join(texts)


def _stop(finish: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _blocks(co: ChoiceOutput) -> list[dict]:
    blocks = []
    if co.reasoning:
        blocks.append({"type": "thinking", "thinking": "".join(co.reasoning), "signature": ""})
    blocks.append({"type": "text", "text": "".join(co.content)})
    return blocks


def _kind(delta: dict) -> tuple[str, str] | None:
    """(block type, text) of one ChoiceOutput delta."""
    if delta.get("reasoning_content"):
        return "thinking", delta["reasoning_content"]
    if delta.get("content"):
        return "text", delta["content"]
    return None


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    settings = request.app.state.settings
    prep = await prepare_chat(engine, settings, body.chat_messages(), body.sampling_params())
    mid = new_id("msg")
    stream = prep.stream(engine, mid)
    co = ChoiceOutput(prep.plan)
    head = {"id": mid, "type": "message", "role": "assistant", "model": model}
    if not body.stream:
        done = await unless_disconnected(request, collect(request, stream, 1))
        c = done.completions[0]
        co.feed(c.text)
        co.finish()
        reason, seq = _stop(c.finish_reason, c.stop_reason)
        u = done.last.usage
        usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens}
        return JSONResponse({**head, "content": _blocks(co), "stop_reason": reason,
                             "stop_sequence": seq, "usage": usage})  # fmt: skip

    outs = drive(request, stream)
    first = await anext(outs)  # a bad request fails here, as a plain 400 before any event

    async def events() -> AsyncIterator[Event]:
        try:
            usage = {"input_tokens": len(first.prompt_token_ids or ()), "output_tokens": 0}
            msg = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
            yield "message_start", {"type": "message_start", "message": {**msg, "usage": usage}}
            blocks = _BlockStream()
            last, finish, stop = first, None, None
            async for out in with_first(first, outs):
                last = out
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                for c in out.outputs:
                    deltas = co.feed(c.text) + (co.finish() if c.finish_reason else [])
                    if c.finish_reason:
                        finish, stop = c.finish_reason, c.stop_reason
                    for kind, text in filter(None, map(_kind, deltas)):
                        for e in blocks.add(kind, text):
                            yield e
            for e in blocks.close():
                yield e
            reason, seq = _stop(finish, stop)
            yield (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {"output_tokens": last.usage.completion_tokens},
                },
            )
            yield "message_stop", {"type": "message_stop"}
        finally:
            await outs.aclose()

    def on_error(e: APIError) -> Event:
        kind = _ERROR_TYPES.get(e.status, "api_error")
        return "error", {"type": "error", "error": {"type": kind, "message": e.message}}

    return named_sse_response(events(), on_error)


def _ev(kind: str, **data: Any) -> Event:
    return kind, {"type": kind, **data}


class _BlockStream:
    """Content-block events: a block opens when the kind of text changes, the open one closes."""

    def __init__(self):
        self.index, self.kind = -1, None

    def add(self, kind: str, text: str) -> list[Event]:
        out = self._open(kind) if kind != self.kind else []
        field = "thinking" if kind == "thinking" else "text"
        delta = {"type": f"{kind}_delta", field: text}
        return [*out, _ev("content_block_delta", index=self.index, delta=delta)]

    def close(self) -> list[Event]:
        out = self._open("text") if self.kind is None else []  # an empty answer: one empty block
        return [*out, _ev("content_block_stop", index=self.index)]

    def _open(self, kind: str) -> list[Event]:
        first = self.kind is None
        out = [] if first else [_ev("content_block_stop", index=self.index)]
        self.index, self.kind = self.index + 1, kind
        block = {"type": "text", "text": ""}
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        out.append(_ev("content_block_start", index=self.index, content_block=block))
        if first:
            out.append(_ev("ping"))
        return out
