"""`create_app` guards and error mapping, in process over httpx's ASGI transport (no model needed).

A stub engine stands in where only its surface matters: auth, body limit, CORS, validation and
the timeout are the server's own work.
"""

import asyncio
from types import SimpleNamespace

import httpx

from localllm.app.server.app import create_app
from localllm.app.server.settings import ServerSettings
from localllm.engine.core.outputs import CompletionOutput, RequestOutput


class StubEngine:
    """Answers every chat with one slow token, so the timeout and shapes can be observed."""

    max_model_len = 256
    alive = True
    tokenizer = SimpleNamespace(chat_template=None, longest_piece=16)  # no template: plain chat

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.closed: list[str] = []

    async def chat(self, messages, params, request_id, **kw):
        try:
            await asyncio.sleep(self.delay)
            out = CompletionOutput(0, "hi", [5], finish_reason="stop")
            yield RequestOutput(request_id, None, [1, 2], [out], finished=True)
        finally:
            self.closed.append(request_id)


def _run(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def _app(engine=None, **settings):
    return create_app(engine or StubEngine(), ServerSettings(model_id="m", **settings))


def _is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_api_key_guards_every_route_but_health():
    app = _app(api_key="k")
    assert _run(app, "GET", "/health").status_code == 200
    _is_openai_error(_run(app, "GET", "/v1/models"), 401)
    bad = {"Authorization": "Bearer nope"}
    _is_openai_error(_run(app, "POST", "/v1/chat/completions", json=CHAT, headers=bad), 401)
    ok = _run(app, "GET", "/v1/models", headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"


def test_body_limit_checks_content_length_and_streamed_bytes():
    app = _app(max_body_bytes=100)
    big = {**CHAT, "messages": [{"role": "user", "content": "y" * 200}]}
    err = _is_openai_error(_run(app, "POST", "/v1/chat/completions", json=big), 413)
    assert err["code"] == "body_too_large"

    async def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        for _ in range(5):
            yield b"x" * 50

    _is_openai_error(_run(app, "POST", "/v1/chat/completions", content=chunks()), 413)
    assert _run(app, "POST", "/v1/chat/completions", json=CHAT).status_code == 200


def test_validation_errors_are_400_in_openai_shape():
    app = _app()
    r = _run(app, "POST", "/v1/chat/completions", content=b"{nope",
             headers={"content-type": "application/json"})  # fmt: skip
    assert "not valid JSON" in _is_openai_error(r, 400)["message"]
    r = _run(app, "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": "many"})
    assert _is_openai_error(r, 400)["param"] == "max_tokens"
    r = _run(app, "POST", "/v1/chat/completions", json={**CHAT, "top_p": 3})
    assert "top_p" in _is_openai_error(r, 400)["message"]
    r = _run(app, "POST", "/v1/chat/completions", json={**CHAT, "model": "other"})
    assert _is_openai_error(r, 404)["code"] == "model_not_found"
    _is_openai_error(_run(app, "GET", "/no/such/route"), 404)


def test_cors_is_off_unless_an_origin_is_given():
    pre = {"Origin": "http://a.test", "Access-Control-Request-Method": "POST"}
    off = _run(_app(), "OPTIONS", "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in off.headers
    on = _run(_app(cors_origins=("http://a.test",)), "OPTIONS", "/v1/models", headers=pre)
    assert on.status_code == 200
    assert on.headers["access-control-allow-origin"] == "http://a.test"


def test_request_timeout_gives_408_and_closes_the_engine_stream():
    engine = StubEngine(delay=5.0)
    app = _app(engine, request_timeout=0.2)
    err = _is_openai_error(_run(app, "POST", "/v1/chat/completions", json=CHAT), 408)
    assert err["code"] == "timeout"
    assert len(engine.closed) == 1  # leaving the stream is what aborts it in the real engine
    fast = _app(StubEngine(), request_timeout=5.0)
    body = _run(fast, "POST", "/v1/chat/completions", json=CHAT).json()
    assert body["choices"][0]["message"]["content"] == "hi"
    assert body["usage"]["completion_tokens"] == 0  # the stub reports no usage


def test_metrics_expose_vllm_names():
    engine = StubEngine()
    kv = SimpleNamespace(usage=0.25, num_free_blocks=3, stats=SimpleNamespace(queries=10, hits=4))
    sched = SimpleNamespace(running=[1, 2], waiting=[3])
    engine.engine = SimpleNamespace(kv_manager=kv, scheduler=sched)
    app = _app(engine)
    _run(app, "POST", "/v1/chat/completions", json=CHAT)
    text = _run(app, "GET", "/metrics").text
    lab = '{model_name="m"}'
    for line in (
        f"vllm:num_requests_running{lab} 2.0",
        f"vllm:num_requests_waiting{lab} 1.0",
        f"vllm:kv_cache_usage_perc{lab} 0.25",
        f"vllm:prefix_cache_queries_total{lab} 10.0",
        f"vllm:prefix_cache_hits_total{lab} 4.0",
        'vllm:request_success_total{model_name="m",finished_reason="stop"} 1.0',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ):
        assert line in text.splitlines(), line
