"""/v1/completions, /v1/models, /tokenize, /detokenize, /metrics on the real server."""

import openai
import pytest

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox"


def _complete(client, prompt=TEXT, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, **kw)


def test_string_and_token_id_prompts_agree_and_stream_matches(server):
    client = server.openai()
    by_text = _complete(client)
    ids = server.http().post("/tokenize", json={"content": TEXT}).json()["tokens"]
    by_ids = _complete(client, prompt=ids)
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in _complete(client, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text
    both = _complete(client, prompt=[TEXT, "Once upon a time"], n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == by_text.choices[0].text
    assert both.choices[2].text != both.choices[0].text
    listed = _complete(client, prompt=[ids, ids])
    assert [c.text for c in listed.choices] == [by_text.choices[0].text] * 2
    texts = {0: "", 1: "", 2: "", 3: ""}
    usage = None
    for c in _complete(client, prompt=[TEXT, "Once upon a time"], n=2, stream=True, echo=True,
                       stream_options={"include_usage": True}):  # fmt: skip
        usage = c.usage or usage
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {0: TEXT + both.choices[0].text, 1: TEXT + both.choices[1].text,
                     2: "Once upon a time" + both.choices[2].text,
                     3: "Once upon a time" + both.choices[3].text}  # fmt: skip
    assert usage.completion_tokens == 32 and usage.prompt_tokens == both.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):  # one bad prompt fails the whole request
        _complete(client, prompt=["fine", [10**9]], stream=True)


def test_echo_and_legacy_logprobs(server):
    client = server.openai()
    plain = _complete(client).choices[0].text
    echoed = _complete(client, echo=True).choices[0].text
    assert echoed == TEXT + plain
    lp = _complete(client, logprobs=2).choices[0].logprobs
    assert "".join(lp.tokens) == plain and len(lp.token_logprobs) == 8
    assert lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == val and top[tok] == val  # greedy: top-1
    both = _complete(client, echo=True, logprobs=1).choices[0].logprobs
    n_prompt = len(both.tokens) - 8
    assert "".join(both.tokens) == TEXT + plain
    assert both.token_logprobs[0] is None and all(v <= 0 for v in both.token_logprobs[1:])
    assert both.token_logprobs[n_prompt:] == lp.token_logprobs


def test_models_list(server):
    models = server.openai().models.list().data
    assert [m.id for m in models] == [server.model_id]
    raw = server.http().get("/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 1024 and raw["owned_by"] == "localllm"
    assert server.http().get("/version").json()["version"]


def test_tokenize_detokenize_round_trip(server):
    http = server.http()
    text = "Hello, world! Ünïcode and 123."
    ids = http.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
    assert len(ids) > 5 and all(isinstance(i, int) for i in ids)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = [x.encode() if isinstance(x, str) else bytes(x) for x in (p["piece"] for p in pieces)]
    assert any(isinstance(p["piece"], list) for p in pieces)  # "Ü" is split across tokens
    assert b"".join(raw).decode() == text
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_metrics_count_tokens_of_each_request(server):
    before = server.metrics()
    resp = _complete(server.openai(), max_tokens=5)
    after = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert name in after
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["vllm:prompt_tokens_total"] == resp.usage.prompt_tokens
    assert d["vllm:generation_tokens_total"] == 5
    assert d['vllm:request_success_total{finished_reason="length"}'] == 1
    assert d["vllm:time_to_first_token_seconds_count"] == 1
    assert d["vllm:prefix_cache_queries_total"] == resp.usage.prompt_tokens
