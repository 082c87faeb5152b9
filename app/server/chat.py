"""POST /v1/chat/completions: messages through the chat template, streamed (SSE) or whole."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from localllm.app.server.common import (
    chat_logprobs,
    new_id,
    now,
    resolve_model,
    usage_dict,
)
from localllm.app.server.protocol import ChatCompletionRequest
from localllm.app.server.sse import sse_response
from localllm.app.server.streams import collect, drive, unless_disconnected, with_first
from localllm.engine.core.outputs import RequestOutput

router = APIRouter()


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _delta(c, tok, k: int | None) -> dict:
    ch = {
        "index": c.index,
        "delta": {"content": c.text} if c.text else {},
        "logprobs": None,
        "finish_reason": _finish(c.finish_reason),
    }
    if k is not None and c.logprobs:
        ch["logprobs"] = {"content": chat_logprobs(tok, c.token_ids, c.logprobs, k)}
    return ch


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    params = body.to_sampling_params()
    messages = [m.for_template() for m in body.messages]
    rid = new_id("chatcmpl")
    stream = engine.chat(
        messages,
        params,
        rid,
        chat_template_kwargs=body.chat_template_kwargs,
        cache_salt=body.cache_salt,
    )
    k = params.logprobs
    tok = engine.tokenizer
    if not body.stream:
        done = await unless_disconnected(request, collect(request, stream, params.n))
        choices = []
        for c in done.completions:
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": _finish(c.finish_reason),
            }
            if k is not None:
                choice["logprobs"] = {"content": chat_logprobs(tok, c.token_ids, c.logprobs, k)}
            choices.append(choice)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": now(),
                "model": model,
                "choices": choices,
                "usage": usage_dict(done.last.usage),
            }
        )

    outs = drive(request, stream)
    first = await anext(outs)  # a bad request fails here, as a plain 400 before any event
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = now()

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        d = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            d["usage"] = usage
        return d

    async def chunks() -> AsyncIterator[dict]:
        try:
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
                    for i in range(params.n)
                ]
            )  # fmt: skip
            last: RequestOutput = first
            async for out in with_first(first, outs):
                last = out
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                choices = [_delta(c, tok, k) for c in out.outputs]
                choices = [ch for ch in choices if ch["delta"] or ch["finish_reason"]]
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage_dict(last.usage))
        finally:
            await outs.aclose()

    return sse_response(chunks())
