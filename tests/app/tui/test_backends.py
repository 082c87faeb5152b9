"""The backend seam without Textual: the OpenAI endpoint client over a mock transport, settings
validation, token-rate figures, and which pastes count as model references."""

import json

import httpx
import pytest

from localllm.app.tui.backend import ChatDelta, GenSettings, chat_messages
from localllm.app.tui.drop import drop_spec
from localllm.app.tui.endpoint_backend import EndpointBackend, EndpointError, api_base
from localllm.app.tui.stats import GenStats, status_text

pytestmark = pytest.mark.anyio


def sse(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def fake_server(seen: list[httpx.Request]):
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served", "max_model_len": 4096}]})
        body = sse(
            {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
            {"choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]},
            {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return handle


async def test_endpoint_streams_text_usage_and_sends_settings():
    seen: list[httpx.Request] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake_server(seen)))
    backend = await EndpointBackend("http://box:8080", client=client).connect()
    assert (backend.name, backend.max_model_len) == ("served", 4096)
    settings = GenSettings(system_prompt="be brief", temperature=0.2, top_p=0.5, max_tokens=9)
    msgs = chat_messages([("user", "hi")], settings)
    deltas = [d async for d in backend.stream(msgs, settings)]
    assert deltas == [
        ChatDelta("Hel", None, None, None),
        ChatDelta("lo", None, None, "stop"),
        ChatDelta("", 7, 2, None),
    ]
    body = json.loads(seen[-1].content)
    assert seen[-1].url == "http://box:8080/v1/chat/completions"
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == (
        "served",
        0.2,
        0.5,
        9,
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    await backend.close()


async def test_endpoint_http_error_is_reported():
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(400, text="bad model"))
    )
    backend = EndpointBackend("http://box/v1/", model="m", client=client)
    with pytest.raises(EndpointError, match="HTTP 400: bad model"):
        async for _ in backend.stream([{"role": "user", "content": "x"}], GenSettings()):
            pass


def test_api_base_normalises_urls():
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"
    with pytest.raises(ValueError, match="http"):
        api_base("h:1")


def test_gen_settings_validate_and_merge():
    with pytest.raises(ValueError, match="temperature"):
        GenSettings(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        GenSettings(top_p=0)
    merged = GenSettings.from_dict({"temperature": 0.1, "junk": 1}, GenSettings(max_tokens=7))
    assert (merged.temperature, merged.max_tokens, merged.top_p) == (0.1, 7, 0.95)


def test_stats_rate_and_context():
    s = GenStats(started=0.0)
    s.update(ChatDelta("a", 10, 1), now=1.0)
    assert s.tokens_per_s is None  # one token gives no rate yet
    s.update(ChatDelta("b", 10, 5), now=3.0)
    assert s.tokens_per_s == 2.0  # 4 tokens after the first in 2 s
    assert status_text("m", "ready", s, 100) == "m · ready · 2.0 tok/s · ctx 15/100 (15%)"
    assert status_text(None, "loading", None, None) == "no model · loading"


def test_drop_spec_recognises_only_model_references(tmp_path):
    gguf = tmp_path / "my model.gguf"
    gguf.write_bytes(b"GGUF")
    assert drop_spec(str(gguf)).path == gguf
    assert drop_spec(f"'{gguf}'").path == gguf  # terminals quote dropped paths
    assert drop_spec(str(gguf).replace(" ", "\\ ")).path == gguf
    hub = drop_spec("bartowski/Qwen-GGUF:q4_k_m")
    assert (hub.kind, hub.repo, hub.quant) == ("hub", "bartowski/Qwen-GGUF", "q4_k_m")
    assert drop_spec("https://huggingface.co/org/model").repo == "org/model"
    assert drop_spec("org/some-GGUF").repo == "org/some-GGUF"
    for text in ("and/or", "hello world", str(tmp_path / "missing.gguf"), "", "a\nb"):
        assert drop_spec(text) is None, text
