"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

A request becomes chat messages and a `ToolRequest` (`anthropic_request`) and goes through the
same preparation as OpenAI chat, tools included; the answer's reasoning, text and tool calls come
back as content blocks (`anthropic_output`). The stream is Anthropic's event sequence:
message_start, content_block_start, ping, content_block_delta..., content_block_stop, ...,
message_delta (stop_reason, usage), message_stop. Errors are in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, before a stream as inside one.
"""

import asyncio
import json
import secrets
import string
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from localllm.app.server.anthropic_output import BlockStream, blocks, stop, usage
from localllm.app.server.anthropic_request import MessagesBody, MessagesRequest
from localllm.app.server.chat_output import ChoiceOutput
from localllm.app.server.chat_prep import prepare_chat
from localllm.app.server.common import resolve_model
from localllm.app.server.errors import APIError, error_response, to_api_error
from localllm.app.server.sse_events import Event, named_sse_response
from localllm.app.server.streams import collect, drive, unless_disconnected, with_first
from localllm.engine.sampling.params import SamplingParams

# Anthropic's error types by status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
_ID_CHARS = string.ascii_letters + string.digits


def message_id() -> str:
    """`msg_` and 24 base62 characters, the shape of Anthropic's ids."""
    return "msg_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _error(e: APIError) -> dict:
    kind = _ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class AnthropicRoute(APIRoute):
    """Errors of these routes (bad JSON and fields too) answered in Anthropic's shape, with the
    status and message the app's OpenAI mapping gives them."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                answer = await _app_answer(request, exc)
                body = json.loads(answer.body)["error"]
                e = APIError(answer.status_code, body["message"])
                return JSONResponse(_error(e), status_code=e.status)

        return run


async def _app_answer(request: Request, exc: Exception) -> JSONResponse:
    handlers = request.app.exception_handlers
    for kind in type(exc).__mro__:
        if kind in handlers:
            return await handlers[kind](request, exc)
    e = to_api_error(exc)
    return error_response(e.status, e.message)


router = APIRouter(route_class=AnthropicRoute)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesBody, request: Request) -> JSONResponse:
    """The prompt's tokens for the same body, without generating: the messages, system and
    tools rendered by the chat template as /v1/messages renders them."""
    _, engine = await resolve_model(request, body.model)
    prep = await prepare_chat(engine, request.app.state.settings, body.chat_messages(),
                              SamplingParams(max_tokens=1), body.tool_request())  # fmt: skip
    if prep.prompt is not None:  # with images: the ids hold each image's expanded tokens
        return JSONResponse({"input_tokens": len(prep.prompt[0])})
    ids = await asyncio.to_thread(
        engine.engine.chat_prompt,
        prep.messages,
        tools=prep.tools,
        continue_final=prep.continue_final,  # a trailing assistant message is a prefill
        **prep.template_kwargs,
    )
    return JSONResponse({"input_tokens": len(ids)})


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    settings = request.app.state.settings
    prep = await prepare_chat(engine, settings, body.chat_messages(), body.sampling_params(),
                              body.tool_request())  # fmt: skip
    mid = message_id()
    stream = prep.stream(engine, mid)
    co = ChoiceOutput(prep.plan)
    head = {"id": mid, "type": "message", "role": "assistant", "model": model}
    if not body.stream:
        done = await unless_disconnected(request, collect(request, stream, 1))
        c = done.completions[0]
        co.feed(c.text)
        co.finish()
        reason, seq = stop(c.finish_reason, c.stop_reason, bool(co.calls))
        return JSONResponse({**head, "content": blocks(co), "stop_reason": reason,
                             "stop_sequence": seq, "usage": usage(done.last.usage)})  # fmt: skip

    outs = drive(request, stream)
    first = await anext(outs)  # a bad request fails here, as a plain 400 before any event

    async def events() -> AsyncIterator[Event]:
        try:
            msg = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
            start = {**msg, "usage": usage(first.usage, output_tokens=0)}
            yield "message_start", {"type": "message_start", "message": start}
            out_blocks = BlockStream()
            last, finish, stop_at = first, None, None
            async for out in with_first(first, outs):
                last = out
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                for c in out.outputs:
                    deltas = co.feed(c.text) + (co.finish() if c.finish_reason else [])
                    if c.finish_reason:
                        finish, stop_at = c.finish_reason, c.stop_reason
                    for d in deltas:
                        for e in out_blocks.add(d):
                            yield e
            for e in out_blocks.close():
                yield e
            reason, seq = stop(finish, stop_at, bool(co.calls))
            delta = {"stop_reason": reason, "stop_sequence": seq}
            yield "message_delta", {"type": "message_delta", "delta": delta,
                                    "usage": usage(last.usage)}  # fmt: skip
            yield "message_stop", {"type": "message_stop"}
        finally:
            await outs.aclose()

    def on_error(e: APIError) -> Event:
        return "error", _error(e)

    return named_sse_response(events(), on_error)
