"""GLM tool calls end to end: a real `localllm serve` of the converted GLM fixture (its real GLM-4.6
chat template, llama.cpp's conversion) over a socket, with the official `openai` client.

Its weights are random, so only forced calls say something: the grammar makes it write GLM's
format (`<tool_call>NAME` then `<arg_key>`/`<arg_value>` pairs, string values as raw text, the
others as JSON), which must come back as `tool_calls` whose arguments fit the schema, streamed
or not; and the call with its result goes back through the template.
"""

import json

import jsonschema
import openai
import pytest

from tests.app.server.conftest import serve_process
from tests.engine.family_goldens import path

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"], "additionalProperties": False}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    with serve_process(["-m", str(path("glm4moe")), "--ctx-size", "2048"], d) as (url, _):
        yield url


def _chat(base, **kw):
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 120, **kw}
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    return client.chat.completions.create(model="glm4moe", **kw)


def test_forced_call_comes_back_as_tool_calls(base):
    resp = _chat(base, tools=[WEATHER, TIME], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {"get_weather": PARAMS, "get_time": ZONE}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)  # typed: days an integer
    chunks = list(_chat(base, tools=[WEATHER, TIME], tool_choice="required", stream=True))
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert parts[0].function.name == call.function.name and parts[0].id
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the call and its result go back through GLM's template (an <|observation|> turn)
    result = {"role": "tool", "tool_call_id": call.id, "content": "4 C"}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    again = _chat(base, messages=history, tools=[WEATHER, TIME], max_tokens=4)
    assert again.usage.prompt_tokens > resp.usage.prompt_tokens


def test_named_choice_forces_that_tool(base):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = _chat(base, tools=[WEATHER, TIME], tool_choice=choice)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS)
    assert isinstance(args["days"], int) and args["unit"] in ("celsius", "fahrenheit")
