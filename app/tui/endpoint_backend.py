"""An OpenAI-compatible server as a chat backend (`localllm --endpoint URL`), streamed with httpx.

Stopping generation closes the HTTP stream; servers (ours, vLLM, llama.cpp) abort the request on
disconnect. `connect` asks `/v1/models` for the model id and, where the server says, its context.
A reasoning model's `reasoning_content` deltas (`reasoning` in newer vLLM) come through as
`ChatDelta.reasoning`.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx

from localllm.app.tui.backend import ChatDelta, GenSettings
from localllm.app.tui.images import openai_messages


def api_base(url: str) -> str:
    """`http://host:8080`, `.../v1` and `.../v1/` all mean `http://host:8080/v1`."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint must be an http(s) URL, got {url!r}")
    return url if url.endswith("/v1") else url + "/v1"


class EndpointError(RuntimeError):
    """The server answered with an error or something that is not an OpenAI stream."""


class EndpointBackend:
    model_bytes = 0

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        client: httpx.AsyncClient | None = None,
    ):
        self.base = api_base(url)
        self.model = model
        self.name = model or self.base
        self._max_len: int | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(30, read=None)  # a slow model may think long between tokens
        self.client = client or httpx.AsyncClient(headers=headers, timeout=timeout)

    @property
    def max_model_len(self) -> int | None:
        return self._max_len

    async def connect(self) -> "EndpointBackend":
        """Pick the served model (the first, unless one was named) and its context length."""
        try:
            r = await self.client.get(f"{self.base}/models")
            r.raise_for_status()
            cards = r.json().get("data") or []
        except (httpx.HTTPError, ValueError) as e:
            raise EndpointError(f"cannot list models at {self.base}: {e}") from None
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else None)
        if card is None:
            raise EndpointError(f"{self.base} serves no models")
        self.model = card["id"]
        self.name = card["id"]
        ctx = card.get("max_model_len") or card.get("context_length")
        self._max_len = ctx if isinstance(ctx, int) else None
        return self

    def _body(self, messages: Sequence[Mapping[str, str]], s: GenSettings) -> dict[str, Any]:
        return {
            "model": self.model or "default",
            "messages": list(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
        }

    async def stream(
        self, messages: Sequence[Mapping[str, str]], settings: GenSettings
    ) -> AsyncIterator[ChatDelta]:
        url = f"{self.base}/chat/completions"
        messages = await asyncio.to_thread(openai_messages, list(messages))  # attached images
        async with self.client.stream("POST", url, json=self._body(messages, settings)) as r:
            if r.status_code >= 400:
                body = (await r.aread()).decode(errors="replace")
                raise EndpointError(f"{url}: HTTP {r.status_code}: {body[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                delta = _delta(data)
                if delta is not None:
                    yield delta

    async def close(self) -> None:
        await self.client.aclose()


def _delta(data: str) -> ChatDelta | None:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise EndpointError(f"not an OpenAI stream chunk: {data[:200]}") from None
    if "error" in chunk:
        raise EndpointError(str(chunk["error"].get("message", chunk["error"])))
    usage = chunk.get("usage") or {}
    choices = chunk.get("choices") or []
    text, reasoning, finish = "", "", None
    if choices:
        delta = choices[0].get("delta") or {}
        text = delta.get("content") or ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        finish = choices[0].get("finish_reason")
    if not text and not reasoning and not finish and not usage:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return ChatDelta(text, prompt, completion, finish, reasoning)
