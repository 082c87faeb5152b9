"""Helpers every generation endpoint shares: model-name check, ids, usage and logprob shapes."""

import asyncio
import re
import time
import uuid
from typing import Any

from fastapi import Request

from localllm.app.server import lora
from localllm.app.server.errors import APIError
from localllm.app.server.settings import ServerSettings
from localllm.engine.core.outputs import PositionLogprobs, Usage

# Raw UTF-8 cannot encode a surrogate: only a JSON escape of one can put it in a string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_model(request: Request, model: str | None) -> str:
    """The id to report; 404 when the request names a model this server does not serve."""
    return request.app.state.router.find(model).id


async def resolve_model(request: Request, model: str | None) -> tuple[str, Any]:
    """The id to report and the engine that serves the named model (404 when none does).

    Every generation endpoint goes through here, so this is where the router loads the model
    (in a thread), and where the per-request `timeout` and the prompt-size limit in characters
    are checked: before any tokenization or engine time.
    """
    router = request.app.state.router
    entry = router.find(model)
    settings = request.app.state.settings
    body = await json_body(request)
    if _SURROGATE_ESCAPE.search(await request.body()):  # else no string can hold a surrogate
        await asyncio.to_thread(check_unicode, body)
    timeout = request_timeout(settings, body)
    check_prompt_chars(settings, body)
    request.state.timeout = timeout
    request.state.model_id = entry.id
    engine = await router.acquire(entry, timeout)
    return lora.route(model, entry.id, engine)  # a --lora-modules name: its adapter applied


async def json_body(request: Request) -> dict:
    """The request's JSON object (FastAPI has parsed and cached it already), or {}."""
    if "json" not in request.headers.get("content-type", ""):
        return {}
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def check_unicode(body: Any) -> None:
    """400 for a string that is not valid Unicode text: JSON's `\\ud800` escape decodes to a lone
    surrogate, which no tokenizer, template or UTF-8 encoder takes. Iterative: bodies nest deep.
    Paths are (parent, key) pairs, spelled out only for the error."""
    todo: list[tuple[Any, Any]] = [(body, None)]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                where = _spelled(path)
                at = f" in {where}" if where else ""
                raise APIError(
                    400,
                    f"invalid Unicode{at}: a lone surrogate {value[e.start]!r} at character "
                    f"{e.start}",
                    param=where or None,
                ) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, path))
                if isinstance(v, str | dict | list):
                    todo.append((v, (path, k)))
        elif isinstance(value, list):
            nested = (v for v in enumerate(value) if isinstance(v[1], str | dict | list))
            todo += [(v, (path, i)) for i, v in nested]


def _spelled(path: Any) -> str:
    keys = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else str(key)
    return out


def request_timeout(settings: ServerSettings, body: dict) -> float | None:
    """The request's `timeout` field (seconds, an extra body field in vLLM / llama-server
    clients), never longer than the server's `--timeout`."""
    server = settings.request_timeout
    value = body.get("timeout")
    if value is None:
        return server
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise APIError(400, "timeout must be a number of seconds > 0", param="timeout")
    return float(value) if server is None else min(float(value), server)


# Body fields whose strings are prompt text, across the endpoint families.
PROMPT_FIELDS = ("prompt", "messages", "input", "input_prefix", "input_suffix", "input_extra",
                 "suffix", "content", "system", "instructions")  # fmt: skip


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):  # a message's role, a part's type, an image: not prompt text
        return sum(_chars(v) for k, v in value.items() if k not in ("role", "type", "image_url"))
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


def check_prompt_chars(settings: ServerSettings, body: dict) -> None:
    """400 when the prompt text is longer than `--max-prompt-chars` (before tokenizing it)."""
    limit = settings.max_prompt_chars
    if limit is None:
        return
    n = sum(_chars(body.get(f)) for f in PROMPT_FIELDS)
    if n > limit:
        raise APIError(
            400,
            f"the prompt has {n} characters; this server takes at most {limit}",
            code="prompt_too_long",
        )


def prompt_chars(value: Any) -> int:
    """Characters of prompt text in a body field (messages, a prompt, content parts)."""
    return _chars(value)


def check_context_chars(engine: Any, chars: int) -> None:
    """400 when `chars` characters of prompt cannot fit the model's context, before any
    rendering or tokenizing: a token covers at most `longest_piece` bytes, so at most as many
    characters, and such a prompt is more tokens than the context holds."""
    ctx, longest = engine.max_model_len, engine.tokenizer.longest_piece
    if chars > ctx * longest:
        raise APIError(
            400,
            f"the prompt has {chars} characters, more than fit the model's context of {ctx} "
            f"tokens (its longest token is {longest} bytes)",
            code="context_length_exceeded",
        )


def check_choices(request: Request, count: int) -> None:
    """400 when a request asks for more completions than `--max-n` (n, or n times the prompts of
    a batch): a thousand of them would hold the engine while every other client waits."""
    limit = request.app.state.settings.max_n
    if count > limit:
        raise APIError(
            400,
            f"this request asks for {count} completions; this server makes at most {limit} per "
            "request (--max-n)",
            param="n",
            code="too_many_choices",
        )


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
