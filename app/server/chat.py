"""POST /v1/chat/completions: messages through the chat template, streamed (SSE) or whole.

Tools, tool_choice and the `<think>` split are prepared in `chat_prep` and read back per choice by
`chat_output`; this module only shapes OpenAI's chunks and responses.
"""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from localllm.app.server.chat_output import ChoiceOutput
from localllm.app.server.chat_prep import ToolRequest, prepare_chat
from localllm.app.server.common import (
    chat_logprobs,
    check_choices,
    new_id,
    now,
    resolve_model,
    usage_dict,
)
from localllm.app.server.errors import APIError
from localllm.app.server.protocol import ChatCompletionRequest
from localllm.app.server.sse import sse_response
from localllm.app.server.streams import collect, drive, unless_disconnected, with_first
from localllm.engine.core.outputs import RequestOutput

router = APIRouter()


def _choice_chunks(c, co: ChoiceOutput, tok, k: int | None) -> list[dict]:
    """Stream choices for one engine delta: one per message part, logprobs on the first, the
    finish reason on the last."""
    deltas = co.feed(c.text)
    if c.finish_reason is not None:
        deltas += co.finish()
    chs = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    lps = None
    if k is not None and c.logprobs:
        lps = {"content": chat_logprobs(tok, c.token_ids, c.logprobs, k)}
    if not chs and (lps or c.finish_reason is not None):
        chs = [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None}]
    if chs and lps:
        chs[0]["logprobs"] = lps
    if chs:
        chs[-1]["finish_reason"] = co.finish_reason(c.finish_reason)
    return chs


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    if body.tool_choice is not None and body.tools is None:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")  # as OpenAI and vLLM
    check_choices(request, body.n)
    tools = None
    if body.tools is not None:
        choice = body.tool_choice
        tools = ToolRequest(
            body.tool_dicts(),
            choice.model_dump() if isinstance(choice, BaseModel) else choice,
            bool(body.parallel_tool_calls),
        )
    prep = await prepare_chat(
        engine,
        request.app.state.settings,
        [m.for_template() for m in body.messages],
        body.to_sampling_params(),
        tools,
        body.template_kwargs(),
        body.continue_final(),
    )
    params = prep.params
    rid = new_id("chatcmpl")
    stream = prep.stream(engine, rid, body.cache_salt)
    k = params.logprobs
    tok = engine.tokenizer
    if not body.stream:
        done = await unless_disconnected(request, collect(request, stream, params.n))
        choices = []
        for c in done.completions:
            co = ChoiceOutput(prep.plan)
            co.feed(c.text)
            co.finish()
            choice = {
                "index": c.index,
                "message": co.message(),
                "logprobs": None,
                "finish_reason": co.finish_reason(c.finish_reason),
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
        readers = [ChoiceOutput(prep.plan) for _ in range(params.n)]
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
                for c in out.outputs:
                    for ch in _choice_chunks(c, readers[c.index], tok, k):
                        yield chunk([ch])
            if include_usage:
                yield chunk([], usage_dict(last.usage))
        finally:
            await outs.aclose()

    return sse_response(chunks())
