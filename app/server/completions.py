"""POST /v1/completions: raw prompts (text, token ids, or lists of them), echo, legacy logprobs,
and `suffix` for fill-in-the-middle (the prompt is the prefix)."""

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from localllm.app.server.common import (
    check_choices,
    check_context_chars,
    new_id,
    now,
    ranked,
    resolve_model,
    token_text,
    usage_dict,
)
from localllm.app.server.infill import fim_ids
from localllm.app.server.protocol import CompletionRequest
from localllm.app.server.sse import sse_response
from localllm.app.server.streams import (
    all_or_none,
    collect,
    drive,
    merged,
    unless_disconnected,
    with_first,
)
from localllm.engine.core.outputs import PositionLogprobs, RequestOutput, Usage

router = APIRouter()


def legacy_logprobs(
    tok, ids: list[int], lps: list[PositionLogprobs | None], k: int, offset: int
) -> dict:
    """OpenAI's completions shape: parallel lists of tokens, their logprobs and top-k maps."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, pos in zip(ids, lps, strict=False):
        text = token_text(tok, t, pos[t].decoded_token if pos else None)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(pos[t].logprob if pos else None)
        tops.append(
            {token_text(tok, i, s): lp for i, lp, s in ranked(pos, k)} if pos and k else None
        )
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def _echo_text(tok, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tok.decode(prompt)


class FimCompletionRequest(CompletionRequest):
    suffix: str | None = None  # text after the insertion point: fill-in-the-middle


async def _fim_prompts(body: FimCompletionRequest, engine, model: str) -> list[list[int]]:
    """Each text prompt as a prefix, with `suffix`, in the model's FIM layout."""
    if body.echo:
        raise ValueError("echo cannot be combined with suffix")
    prompts = body.prompts()
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("suffix needs text prompts (not token ids)")
    suffix = body.suffix or ""
    return [await fim_ids(engine, model, p, suffix, max_tokens=body.max_tokens) for p in prompts]


@router.post("/v1/completions")
async def create_completion(body: FimCompletionRequest, request: Request) -> Response:
    model, engine = await resolve_model(request, body.model)
    params = body.to_sampling_params()
    given = body.prompts()
    check_choices(request, params.n * len(given))
    if body.suffix is None:  # (fill-in-the-middle cuts its prefix and suffix to fit instead)
        for p in given:
            if isinstance(p, str):
                check_context_chars(engine, len(p))
    prompts = given if body.suffix is None else await _fim_prompts(body, engine, model)
    tok = engine.tokenizer
    rid = new_id("cmpl")
    k = body.logprobs

    def start(i: int, prompt):
        return engine.generate(prompt, params, f"{rid}-{i}", cache_salt=body.cache_salt)

    if not body.stream:
        work = all_or_none([collect(request, start(i, p), params.n) for i, p in enumerate(prompts)])
        results = await unless_disconnected(request, work)
        choices, usage = [], Usage()
        for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
            usage.prompt_tokens += res.last.usage.prompt_tokens
            usage.completion_tokens += res.last.usage.completion_tokens
            echo = _echo_text(tok, prompt) if body.echo else ""
            for c in res.completions:
                lp = None
                if k is not None:
                    lp = legacy_logprobs(tok, c.token_ids, c.logprobs or [], k, len(echo))
                    if body.echo:
                        pl = res.last.prompt_logprobs or [None] * len(res.last.prompt_token_ids)
                        head = legacy_logprobs(tok, res.last.prompt_token_ids, pl, k, 0)
                        lp = {key: head[key] + lp[key] for key in lp}
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": echo + c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": now(),
                "model": model,
                "choices": choices,
                "usage": usage_dict(usage),
            }
        )

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = now()
    drives = [drive(request, start(i, p)) for i, p in enumerate(prompts)]
    # Every prompt's first output before the first byte: a bad one fails with a plain 400.
    firsts = await asyncio.gather(*(anext(d) for d in drives), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        for d in drives:
            await d.aclose()
        raise failed[0]
    echoes = [_echo_text(tok, p) if body.echo else "" for p in prompts]

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        d = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": choices}  # fmt: skip
        if include_usage:
            d["usage"] = usage
        return d

    async def chunks() -> AsyncIterator[dict]:
        # All prompts stream at once; the choice index (prompt * n + completion) tells them apart.
        lasts: dict[int, RequestOutput] = {}
        echoed: set[int] = set()
        streams = [with_first(f, d) for f, d in zip(firsts, drives, strict=True)]
        try:
            async for i, out in merged(streams):
                lasts[i] = out
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                choices = []
                for c in out.outputs:
                    idx = i * params.n + c.index
                    text = c.text if idx in echoed else echoes[i] + c.text
                    echoed.add(idx)
                    lp = None
                    if k is not None:
                        lp = legacy_logprobs(tok, c.token_ids, c.logprobs or [], k, 0)
                    choices.append(
                        {"index": idx, "text": text, "logprobs": lp,
                         "finish_reason": c.finish_reason}
                    )  # fmt: skip
                if choices:
                    yield chunk(choices)
            if include_usage:
                total = Usage()
                for last in lasts.values():
                    total.prompt_tokens += last.usage.prompt_tokens
                    total.completion_tokens += last.usage.completion_tokens
                yield chunk([], usage_dict(total))
        finally:
            for d in drives:
                await d.aclose()

    return sse_response(chunks())
