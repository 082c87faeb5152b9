"""Qwen3-Next tool calls end to end: a real `localllm serve` of the converted qwen3next fixture (a
hybrid model: DeltaNet state slots beside the KV cache; Qwen3's real chat template, whose calls
are Hermes' `<tool_call>` JSON) over a socket, with the official `openai` client.

Its weights are random, so only forced calls say something: the grammar makes it write the
Hermes block, which must come back as `tool_calls` whose arguments fit the schema, streamed or
not; the call with its result goes back through the template (a `<tool_response>` turn).
"""

import json

import jsonschema
import openai
import pytest

from localllm.app.server.tool_parsers import HERMES, detect_format
from localllm.engine.gguf import open_gguf
from tests.app.server.conftest import serve_process
from tests.engine.family_goldens import path

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_template_speaks_hermes():
    with open_gguf(path("qwen3next")) as g:
        assert detect_format(g.metadata["tokenizer.chat_template"]) is HERMES


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3next")
    with serve_process(["-m", str(path("qwen3next")), "--ctx-size", "2048"], d) as (url, _):
        yield url


def _chat(base, **kw):
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 80, **kw}
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    return client.chat.completions.create(model="qwen3next", **kw)


def test_forced_call_comes_back_as_tool_calls(base):
    resp = _chat(base, tools=[WEATHER], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    chunks = list(_chat(base, tools=[WEATHER], tool_choice="required", stream=True))
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert parts[0].function.name == call.function.name and parts[0].id
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    result = {"role": "tool", "tool_call_id": call.id, "content": "4 C"}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    again = _chat(base, messages=history, tools=[WEATHER], max_tokens=4)
    assert again.usage.prompt_tokens > resp.usage.prompt_tokens
