"""/v1/chat/completions through the real server and the official `openai` client."""

import json
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.slow

PROMPT = "Write a short poem about the sea."


def _chat(client, content=PROMPT, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": content}], **kw
    )


def test_greedy_chat_equals_localllm_run(server):
    """Same engine, same template: the server's greedy answer is what `localllm run` prints."""
    # A fresh cache salt: a prefix-cache hit left by earlier tests would prefill fewer tokens per
    # step, and the CPU int4 kernels round differently below 64 tokens (near-ties can flip).
    salt = {"cache_salt": uuid.uuid4().hex}
    resp = _chat(server.openai(), max_tokens=20, extra_body=salt)
    cmd = [sys.executable, "-m", "localllm.app", "run", "--temperature", "0", "-n", "20", PROMPT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert resp.choices[0].message.content + "\n" == proc.stdout  # run ends a pipe with "\n"
    assert resp.choices[0].message.role == "assistant"
    assert resp.object == "chat.completion" and resp.model == server.model_id


def test_stream_deltas_concatenate_to_the_non_stream_text(server):
    client = server.openai()
    whole = _chat(client)
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []  # the usage chunk
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_prompt_and_completion_tokens(server):
    client = server.openai()
    resp = _chat(client, max_tokens=7)
    toks = server.http().post("/tokenize", json={"content": ""}).json()["tokens"]
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    # The prompt is the rendered template: longer than the user text alone, and stable.
    assert resp.usage.prompt_tokens > len(toks) + 7
    assert _chat(client, max_tokens=3).usage.prompt_tokens == resp.usage.prompt_tokens


def test_stop_string_cuts_the_greedy_text(server):
    client = server.openai()
    full = _chat(client, max_tokens=20).choices[0].message.content
    word = full.split()[3]
    cut = _chat(client, max_tokens=20, stop=[word, "zzzz"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.index(word)]


def test_n2_and_seed_reproducibility(server):
    client = server.openai()
    kw = dict(temperature=1.0, max_tokens=10, seed=7, n=2)
    a, b = _chat(client, **kw), _chat(client, **kw)
    c = _chat(client, **{**kw, "seed": 8})
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1]
    assert texts == [ch.message.content for ch in b.choices]
    assert texts != [ch.message.content for ch in c.choices]
    assert a.usage.completion_tokens == 20  # both completions count
    greedy = _chat(client, n=2, max_tokens=8)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_max_tokens_omitted_runs_to_a_natural_stop(server):
    resp = _chat(server.openai(), max_tokens=None, content="Say hi.")
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens > 16  # vLLM's default of 16 is not applied


def test_logprobs_and_top_logprobs_shape(server):
    resp = _chat(server.openai(), max_tokens=6, logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        assert bytes(t.bytes).decode() == t.token
    streamed = _chat(server.openai(), max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
    lp_stream = [t for c in streamed if c.choices and c.choices[0].logprobs
                 for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [(t.token, t.logprob) for t in lp_stream] == [(t.token, t.logprob) for t in content]


def test_json_schema_response_format_gives_valid_json(server):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    resp = _chat(server.openai(), max_tokens=60, response_format=fmt, content="A city and year?")
    data = json.loads(resp.choices[0].message.content)
    assert set(data) == {"city", "year"}
    assert isinstance(data["city"], str) and isinstance(data["year"], int)
    # json_object: the constrained text opens an object where the free answer does not.
    free = _chat(server.openai(), max_tokens=8).choices[0].message.content
    obj = _chat(server.openai(), max_tokens=8, response_format={"type": "json_object"})
    assert not free.lstrip().startswith("{")
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_raw_sse_frames_and_n2_stream(server):
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": server.model_id, "messages": messages, "max_tokens": 6, "temperature": 0,
            "n": 2, "stream": True}  # fmt: skip
    with server.http().stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in r.iter_lines() if line]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content", "")
    whole = _chat(server.openai(), max_tokens=6).choices[0].message.content
    assert texts == {0: whole, 1: whole}  # greedy: both completions are the greedy text
