"""Bad input, auth, concurrency and client disconnects against the real server."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.app.server.conftest import MAX_BODY, PARALLEL

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _msg(text):
    return [{"role": "user", "content": text}]


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key_required_except_health(server):
    assert httpx.get(server.base + "/health").status_code == 200
    assert _err(httpx.get(server.base + "/v1/models"), 401)["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    _err(httpx.post(server.base + "/tokenize", json={"content": "x"}), 401)


def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(server):
    http, client = server.http(), server.openai()
    url = "/v1/chat/completions"
    json_type = {"content-type": "application/json"}
    _err(http.post(url, content=b'{"messages": [', headers=json_type), 400)
    _err(http.post(url, json={"model": MODEL, "messages": "hello"}), 400)
    _err(http.post(url, json={"model": MODEL, "messages": _msg("x"), "n": "two"}), 400)
    _err(http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], ["a"]]}), 400)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=_msg("x"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    big = {"model": MODEL, "messages": _msg("z" * (MAX_BODY + 10))}
    assert _err(http.post(url, json=big), 413)["code"] == "body_too_large"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 42}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=_msg("x"), max_tokens=4, response_format=bad_schema
        )
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):  # a streamed request fails before any event
        client.chat.completions.create(model=MODEL, messages=_msg("x"), stream=True, temperature=-1)
    # The file name is accepted as the model id too, and the server still answers.
    ok = client.chat.completions.create(
        model=MODEL + ".gguf", messages=_msg("Hi"), max_tokens=3, temperature=0
    )
    assert ok.usage.completion_tokens == 3


# Counting prompts: each client's text is distinct and its greedy continuation has wide margins,
# so batching noise (logits move by ~0.05 between batch sizes) cannot flip a token.
STARTS = [3, 40, 115, 260, 500, 777, 1200, 3000]


def _count_prompt(start: int) -> str:
    return ", ".join(str(i) for i in range(start, start + 6)) + ","


def _stream_text(server, start: int) -> tuple[str, set[str]]:
    chunks = server.openai().completions.create(
        model=MODEL, prompt=_count_prompt(start), max_tokens=24, temperature=0, stream=True
    )
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), {c.id for c in chunks}


def test_concurrent_streams_are_complete_and_uninterleaved(server):
    client = server.openai()
    expected = [
        client.completions.create(
            model=MODEL, prompt=_count_prompt(s), max_tokens=24, temperature=0
        )
        .choices[0]
        .text
        for s in STARTS
    ]
    # The model does count on: the reference is itself right, and every text is different.
    for s, text in zip(STARTS, expected, strict=True):
        assert text.startswith(f" {s + 6}, {s + 7},"), text
    http = server.http()
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = [pool.submit(_stream_text, server, s) for s in STARTS]
        # Bad requests while the streams run must not disturb them.
        for _ in range(3):
            _err(http.post("/v1/chat/completions", json={"model": MODEL, "messages": 1}), 400)
        got = [f.result(timeout=600) for f in futures]
    assert [text for text, _ in got] == expected
    assert all(len(ids) == 1 for _, ids in got)  # every chunk of a stream carries its own id
    assert len({next(iter(ids)) for _, ids in got}) == len(STARTS)


def _wait_idle(server, deadline_s: float = 120.0) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < end, "requests still running"
        time.sleep(0.2)


def test_client_disconnect_aborts_the_request(server):
    before = _wait_idle(server)
    free = before["localllm:kv_cache_free_blocks"]
    # No max_tokens and ignore_eos: left alone it would run to the end of the context.
    body = {"model": MODEL, "messages": _msg("Count to one thousand."), "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    c = httpx.Client(base_url=server.base, headers=server.headers, timeout=60)
    with c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert any(line.startswith("data: {") for line in got)
        mid = server.metrics()
        assert mid["vllm:num_requests_running"] == 1
        assert mid["localllm:kv_cache_free_blocks"] < free
    after = _wait_idle(server)
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    length = 'vllm:request_success_total{finished_reason="length"}'
    assert after[abort] == before[abort] + 1
    assert after[length] == before[length]  # it did not run to the end of the context
    assert after["localllm:kv_cache_free_blocks"] == free
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1000


def test_client_leaving_a_non_stream_request_aborts_it(server):
    before = _wait_idle(server)
    body = {"model": MODEL, "messages": _msg("Count to one thousand."), "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.base + "/v1/chat/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(30, read=3))  # fmt: skip
    after = _wait_idle(server)
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[abort] == before[abort] + 1
    assert after["localllm:kv_cache_free_blocks"] == before["localllm:kv_cache_free_blocks"]
