"""gpt-oss tool calls end to end: a real `localllm serve` of the synthetic gpt-oss model (harmony
vocabulary and the real gpt-oss chat template) over a socket, with the official clients.

Its weights are random, so only forced calls say something: the grammar makes it write a harmony
call (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, the markers as
its special tokens), which must come back as `tool_calls` / `tool_use`, not as raw text.
"""

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.app.server.conftest import serve_process
from tests.app.server.gpt_oss_gguf import CTX, write_harmony_gguf

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# The gpt-oss template writes `"// " + tool.description`: jinja2 fails on a tool without one.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": PARAMS}}  # fmt: skip
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Time", "parameters": {"type": "object",
        "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}},
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss")
    path = write_harmony_gguf(d / "tiny-gpt-oss.gguf")
    with serve_process(["-m", str(path), "--ctx-size", str(CTX)], d) as (url, _):
        yield url


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)


def _chat(base, **kw):
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 200, **kw}
    return _client(base).chat.completions.create(model="tiny-gpt-oss", **kw)


def test_forced_call_comes_back_as_tool_calls(base):
    plain = _chat(base, max_tokens=1)
    resp = _chat(base, tools=[WEATHER, TIME], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {"get_weather": PARAMS, "get_time": TIME["function"]["parameters"]}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    # The template rendered the tools (its TypeScript-like namespace) into the prompt.
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens + len("namespace functions")
    # Streamed: the name first, then the arguments, reassembling to the same call.
    chunks = list(_chat(base, tools=[WEATHER, TIME], tool_choice="required", stream=True))
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert parts[0].function.name == call.function.name and parts[0].id
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The call and its result go back through the template (its `functions.NAME` tool turn).
    result = {"role": "tool", "tool_call_id": call.id, "content": "4 C"}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    again = _chat(base, messages=history, tools=[WEATHER, TIME], max_tokens=1)
    assert again.usage.prompt_tokens > resp.usage.prompt_tokens + 10


def test_named_choice_and_anthropic_tool_use(base):
    named = {"type": "function", "function": {"name": "get_time"}}
    call = _chat(base, tools=[WEATHER, TIME], tool_choice=named).choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    tools = [
        {"name": "get_time", "description": "", "input_schema": TIME["function"]["parameters"]}
    ]
    msg = client.messages.create(
        model="tiny-gpt-oss", max_tokens=200, messages=ASK, tools=tools,
        tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].name == "get_time"
    assert msg.content[0].input == json.loads(call.function.arguments)
