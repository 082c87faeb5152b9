"""Anthropic /v1/messages through the real server and the official `anthropic` client."""

import json
import re

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Recent `anthropic` clients dropped the sampling arguments from create(); the API takes them.
GREEDY = {"temperature": 0}
PROMPT = "Write a short poem about the sea."


def _client(server, key=None):
    key = key or server.headers["Authorization"].removeprefix("Bearer ")  # sent as x-api-key
    return anthropic.Anthropic(base_url=server.base, api_key=key, max_retries=0)


def _chat(server, messages, max_tokens, **kw):
    resp = server.openai().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )
    return resp.choices[0], resp.usage


def test_message_answers_as_chat_does(server):
    msg = _client(server).messages.create(
        model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    )  # fmt: skip
    choice, usage = _chat(server, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": PROMPT}], 12)  # fmt: skip
    assert msg.type == "message" and msg.role == "assistant" and msg.model == server.model_id
    assert re.fullmatch(r"msg_[A-Za-z0-9]{24,}", msg.id)  # Anthropic's id shape
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == choice.message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    # Anthropic counts prompt tokens read from the cache apart from the input tokens.
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == usage.prompt_tokens
    assert u.cache_creation_input_tokens == 0 and u.output_tokens == 12


def test_usage_reports_prefix_cache_hits(server):
    client = _client(server)
    long = "Facts about the sea. " * 40  # several whole KV blocks, cached after the first run
    kw = dict(model=MODEL, max_tokens=2, extra_body=GREEDY, system=long,
              messages=[{"role": "user", "content": "Name one."}])  # fmt: skip
    client.messages.create(**kw)
    again = client.messages.create(**kw)
    chat = server.openai().chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": long}, {"role": "user", "content": "Name one."}],
    )  # fmt: skip
    u = again.usage
    assert u.cache_read_input_tokens > 100
    assert u.cache_read_input_tokens == chat.usage.prompt_tokens_details.cached_tokens
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(**kw) as s:
        start = next(e for e in s if e.type == "message_start")
        final = s.get_final_message()
    assert start.message.usage.cache_read_input_tokens == u.cache_read_input_tokens
    assert start.message.usage.input_tokens == u.input_tokens
    assert final.usage.cache_read_input_tokens == u.cache_read_input_tokens


def test_stop_sequences_and_top_k(server):
    client = _client(server)
    full = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    text = full.content[0].text
    word = text.split()[3]
    cut = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY,
                                 stop_sequences=[word, "zzzz"],
                                 messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]
    # top_k=1 samples the most likely token only: greedy, whatever the temperature.
    k1 = client.messages.create(model=MODEL, max_tokens=20,
                                extra_body={"temperature": 1.0, "top_k": 1},
                                messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert k1.content[0].text == text
    done = client.messages.create(model=MODEL, max_tokens=300, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Say hi."}])  # fmt: skip
    assert done.stop_reason == "end_turn"


def test_stream_events_and_text(server):
    client = _client(server)
    kw = dict(model=MODEL, max_tokens=10, extra_body=GREEDY,
              messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    raw = [k for k in kinds if k not in ("text",)]  # the helper adds "text" convenience events
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 2 and all(e.delta.type == "text_delta" for e in deltas)
    assert "".join(e.delta.text for e in deltas) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    # The raw frames carry the ping after the first block opens.
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True}
    with server.http().stream("POST", "/v1/messages", json=body) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-1] == "message_stop"


def test_x_api_key_is_checked_and_bad_input_is_400(server):
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, "wrong").messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    client = _client(server)
    bad = [dict(max_tokens=0, messages=[{"role": "user", "content": "hi"}]),
           dict(max_tokens=3, messages=[]),
           dict(max_tokens=3, messages=[{"role": "user", "content": [{"type": "image"}]}]),
           dict(max_tokens=3, messages=[{"role": "system", "content": "hi"}])]  # fmt: skip
    for kw in bad:
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, **kw)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=3,
                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip


WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 10}},
        "required": ["zone"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE = {"disable_parallel_tool_use": True}


def _tools(server, **kw):
    kw = {"model": MODEL, "max_tokens": 60, "messages": ASK, "extra_body": GREEDY, **kw}
    return _client(server).messages.create(**kw)


def test_forced_tool_use_then_the_result_gets_an_answer(server):
    msg = _tools(server, tools=[WEATHER, TIME], tool_choice={"type": "any", **ONE})
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["tool_use"]
    use = msg.content[0]
    assert use.id and use.name in ("get_weather", "get_time")
    schema = (WEATHER if use.name == "get_weather" else TIME)["input_schema"]
    jsonschema.validate(use.input, schema)
    # The same request through chat completions makes the same call (one tool machinery).
    oai = [{"type": "function", "function": {"name": t["name"], "description": t.get(
        "description", ""), "parameters": t["input_schema"]}} for t in (WEATHER, TIME)]  # fmt: skip
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=60, tools=oai, tool_choice="required"
    )
    call = chat.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (use.name, use.input)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # The tool_use and its tool_result go back; the model answers in text.
    result = {"type": "tool_result", "tool_use_id": use.id,
              "content": [{"type": "text", "text": "18 C"}]}  # fmt: skip
    history = [*ASK, {"role": "assistant", "content": msg.content},
               {"role": "user", "content": [result]}]  # fmt: skip
    answer = _tools(server, tools=[WEATHER, TIME], messages=history, max_tokens=15)
    assert answer.content[0].type == "text" and answer.content[0].text
    prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert prompt > msg.usage.input_tokens + msg.usage.cache_read_input_tokens + 10
    named = _tools(server, tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
    assert [(b.type, b.name) for b in named.content] == [("tool_use", "get_time")]
    jsonschema.validate(named.content[0].input, TIME["input_schema"])
    none = _tools(server, tools=[WEATHER, TIME], tool_choice={"type": "none"}, max_tokens=10)
    assert [b.type for b in none.content] == ["text"] and none.stop_reason == "max_tokens"


def test_streamed_tool_use_events_build_the_same_call(server):
    kw = dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather", **ONE})
    whole = _tools(server, **kw)
    client = _client(server)
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK, extra_body=GREEDY,
                                **kw) as s:  # fmt: skip
        events = list(s)
        final = s.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [b.content_block.type for b in starts] == ["tool_use"]
    assert starts[0].content_block.name == "get_weather" and starts[0].content_block.input == {}
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 2 and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == whole.content[0].input
    assert final.stop_reason == "tool_use" and final.content[0].input == whole.content[0].input
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_count_tokens_is_the_prompt_of_the_same_request(server):
    client = _client(server)
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    for kw in (dict(messages=ASK), dict(messages=ASK, system="Be brief.", tools=[WEATHER, TIME]),
               dict(messages=prefill)):  # fmt: skip
        n = client.messages.count_tokens(model=MODEL, **kw)
        msg = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, **kw)
        assert n.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    assert tools.input_tokens > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ASK)


def test_bad_tools_are_400(server):
    client = _client(server)
    cases = [
        dict(tools=[{"name": "f"}]),  # no input_schema
        dict(tools=[{"name": "bad name!", "input_schema": {"type": "object"}}]),
        dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]),  # a server tool
        dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
        dict(tools=[WEATHER], tool_choice={"type": "sometimes"}),
        dict(tool_choice={"type": "any"}),  # no tools
        dict(tools=[WEATHER], messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "image"}]}]}]),
    ]  # fmt: skip
    for kw in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{"model": MODEL, "max_tokens": 3, "messages": ASK, **kw})
        assert e.value.body["type"] == "error", kw
        assert e.value.body["error"]["type"] == "invalid_request_error", kw
