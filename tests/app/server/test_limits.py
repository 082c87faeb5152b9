"""Per-request `timeout`, the prompt-size limit in characters and the context limit.

In process (a stub engine that records what reached it): the character limit is checked before
any tokenizing or generating, and the request's timeout is bounded by the server's. On the real
server: an expired timeout aborts the request in the engine (408, or an error event when
streaming) and a prompt longer than the context is a 400 that costs no engine work.
"""

import asyncio
import json

import httpx
import pytest

from localllm.app.server.app import create_app
from localllm.app.server.settings import ServerSettings
from localllm.engine.core.outputs import CompletionOutput, RequestOutput
from tests.app.server.conftest import CTX


class Tok:
    longest_piece = 1  # one token per character, as `encode` below

    def __init__(self, log: list[str]):
        self.log = log

    def encode(self, text: str, **kw) -> list[int]:
        self.log.append("encode")
        return [1] * len(text)


class StubEngine:
    """One token after `delay` seconds; records every generate and tokenize call."""

    max_model_len, alive = 256, True

    def __init__(self, delay: float = 0.0):
        self.delay, self.log = delay, []
        self.tokenizer = Tok(self.log)

    async def generate(self, prompt, params, request_id, **kw):
        self.log.append("generate")
        try:
            await asyncio.sleep(self.delay)
            out = CompletionOutput(0, "hi", [5], finish_reason="stop")
            yield RequestOutput(request_id, None, [1, 2], [out], finished=True)
        finally:
            self.log.append("closed")


def _post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def _app(engine: StubEngine, **settings):
    return create_app(engine, ServerSettings(model_id="m", **settings))


def test_prompt_chars_are_checked_before_tokenizing():
    engine = StubEngine()
    app = _app(engine, max_prompt_chars=10)
    for path, body in (
        ("/v1/completions", {"prompt": "x" * 11}),
        ("/v1/completions", {"prompt": ["12345", "123456"]}),  # counted over all prompts
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 11}]}),
        ("/tokenize", {"content": "z" * 11}),
        ("/infill", {"input_prefix": "a" * 6, "input_suffix": "b" * 5}),
    ):
        r = _post(app, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "prompt_too_long"
    assert engine.log == []  # nothing was tokenized or generated
    ok = _post(app, "/v1/completions", {"prompt": "x" * 10})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "hi"
    assert _post(app, "/tokenize", {"content": "z" * 10}).json() == {"tokens": [1] * 10}


def test_a_prompt_too_long_for_the_context_by_its_characters_is_refused_unread():
    """More characters than the context's tokens times the longest token: 400 before any
    template rendering or tokenizing (a 6 MB chat used to run for seconds to fail anyway)."""
    engine = StubEngine()  # a 256-token context, one character a token
    app = _app(engine)
    for path, body in (
        ("/v1/completions", {"prompt": "x" * 257}),
        ("/v1/completions", {"prompt": ["ok", "x" * 257]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 257}]}),
    ):
        r = _post(app, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.log == []
    assert _post(app, "/v1/completions", {"prompt": "x" * 256}).status_code == 200


def test_request_timeout_field_is_bounded_by_the_server_timeout():
    slow = StubEngine(delay=30.0)
    r = _post(_app(slow), "/v1/completions", {"prompt": "x", "timeout": 0.2})
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
    assert slow.log == ["generate", "closed"]  # the engine stream was closed: aborted
    capped = StubEngine(delay=30.0)
    r = _post(_app(capped, request_timeout=0.2), "/v1/completions",
              {"prompt": "x", "timeout": 1000})  # fmt: skip
    assert r.status_code == 408 and capped.log == ["generate", "closed"]
    fast = _app(StubEngine(), request_timeout=30.0)
    assert _post(fast, "/v1/completions", {"prompt": "x", "timeout": 20}).status_code == 200
    for bad in ("soon", -1, 0, True):
        r = _post(fast, "/v1/completions", {"prompt": "x", "timeout": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"


MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Left alone, this request runs to the end of the context (about a thousand tokens).
LONG = {"model": MODEL, "prompt": "Count:", "ignore_eos": True, "temperature": 0}


def _idle(server) -> dict:
    from tests.app.server.test_robustness import _wait_idle

    return _wait_idle(server)


@pytest.mark.slow
def test_timeout_aborts_the_request_in_the_engine(server):
    http = server.http()
    before = _idle(server)
    r = http.post("/v1/completions", json={**LONG, "timeout": 0.5})
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
    events = []
    with http.stream("POST", "/v1/completions", json={**LONG, "timeout": 0.5, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    after = _idle(server)
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    length = 'vllm:request_success_total{finished_reason="length"}'
    assert after[abort] == before[abort] + 2 and after[length] == before[length]
    assert after["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]


@pytest.mark.slow
def test_prompt_longer_than_the_context_is_400_before_any_engine_work(server):
    http = server.http()
    before = _idle(server)
    ids = http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    for prompt in (ids * (CTX // len(ids) + 1), "hello world " * CTX):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert "does not fit the context" in r.json()["error"]["message"]
    chat = [{"role": "user", "content": "hello " * CTX}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat})
    assert r.status_code == 400 and "does not fit the context" in r.json()["error"]["message"]
    after = server.metrics()
    for name in ("vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_count"):  # fmt: skip
        assert after[name] == before[name], name  # never scheduled, never prefilled
