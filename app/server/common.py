"""Helpers every generation endpoint shares: model-name check, ids, usage and logprob shapes."""

import time
import uuid
from typing import Any

from fastapi import Request

from localllm.app.server.errors import APIError
from localllm.engine.core.outputs import PositionLogprobs, Usage


def check_model(request: Request, model: str | None) -> str:
    """The id to report; 404 when the request names a model this server does not serve."""
    settings = request.app.state.settings
    if not settings.accepts(model):
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {settings.model_id!r}",
            param="model",
            code="model_not_found",
        )
    return settings.model_id


async def resolve_model(request: Request, model: str | None) -> tuple[str, Any]:
    """The id to report and the `AsyncEngine` that serves the named model (404 when none does).

    Every generation endpoint goes through here, so the multi-model router has one seam.
    """
    return check_model(request, model), request.app.state.engine


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage_dict(u: Usage) -> dict:
    d = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if u.cached_tokens:
        d["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return d


def token_text(tokenizer, token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else tokenizer.decode([token_id])


def ranked(pos: PositionLogprobs, k: int) -> list[tuple[int, float, str | None]]:
    """The top-k entries of one position, most likely first: (id, logprob, text)."""
    top = sorted(pos.items(), key=lambda kv: kv[1].rank)
    return [(t, lp.logprob, lp.decoded_token) for t, lp in top if lp.rank <= k][:k]


def chat_logprobs(tokenizer, ids: list[int], lps: list[PositionLogprobs], k: int) -> list[dict]:
    """OpenAI chat shape: per token {token, logprob, bytes, top_logprobs: [...]}."""

    def entry(t: int, lp: float, text: str | None) -> dict:
        s = token_text(tokenizer, t, text)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for t, pos in zip(ids, lps, strict=False):
        chosen = pos[t]
        e = entry(t, chosen.logprob, chosen.decoded_token)
        e["top_logprobs"] = [entry(*x) for x in ranked(pos, k)]
        content.append(e)
    return content
