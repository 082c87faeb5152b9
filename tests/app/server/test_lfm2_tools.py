"""LFM2's tool calls (`app/server/lfm2_tools.py`): Liquid's pythonic call lists between
`<|tool_call_start|>` / `<|tool_call_end|>`, whole and streamed at every cut, the JSON form a
forced call writes, blocks that are no calls kept as content, the history form read back; then
end to end through a real `localllm serve` of the converted lfm2 fixture (its real template) with
the official `openai` client: a forced call comes back as `tool_calls`, and goes back through the
template with its result."""

import json

import jsonschema
import openai
import pytest

from localllm.app.server.lfm2_tools import Lfm2ToolParser, call_text, parse_block
from localllm.app.server.tool_parsers import LFM2, apply_events, detect_format
from localllm.engine.gguf import open_gguf
from tests.app.server.conftest import serve_process
from tests.engine.family_goldens import path

CALLS = (
    'Checking.<|tool_call_start|>[get_weather(city="Paris", days=2), '
    "search(query='a \"b\"', opts={'n': 3, 'exact': True, 'tags': ['x', None]}), now()]"
    "<|tool_call_end|>"
)
WANT = [
    ("get_weather", {"city": "Paris", "days": 2}),
    ("search", {"query": 'a "b"', "opts": {"n": 3, "exact": True, "tags": ["x", None]}}),
    ("now", {}),
]


def _parse(pieces):
    p = Lfm2ToolParser(new_id=lambda: "id")
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    content, calls = [], []
    apply_events(events, content, calls)
    return "".join(content), [(c.name, json.loads(c.arguments)) for c in calls]


def test_pythonic_calls_whole_and_at_every_cut():
    assert _parse([CALLS]) == ("Checking.", WANT)
    for i in range(len(CALLS) + 1):
        assert _parse([CALLS[:i], CALLS[i:]]) == ("Checking.", WANT), i


def test_json_forms_and_an_unclosed_list():
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    forced = f"<|tool_call_start|>\n{call}\n<|tool_call_end|>"
    assert _parse([forced]) == ("", [("get_weather", {"city": "Oslo"})])
    listed = '<|tool_call_start|>[{"name": "now", "arguments": {}}]<|tool_call_end|> done'
    assert _parse([listed]) == (" done", [("now", {})])
    assert _parse(['<|tool_call_start|>[now(tz="UTC")]']) == ("", [("now", {"tz": "UTC"})])


@pytest.mark.parametrize(
    "body",
    [
        "[get_weather('Paris')]",  # positional
        "[f(**kw)]",
        "[f(x=open('/etc/passwd'))]",  # no literal: never evaluated
        "[f(x={1, 2})]",  # a set: no JSON for it
        "just text",
        "[1, 2]",
        "[" * 500,
    ],
)
def test_blocks_that_are_no_calls_stay_content(body):
    assert parse_block(body) is None
    text = f"a<|tool_call_start|>{body}<|tool_call_end|>b"
    assert _parse([text]) == (text, [])


def test_history_form_reads_back():
    text = call_text([(n, a) for n, a in WANT])
    assert text.startswith(LFM2.trigger) and "get_weather(city=" in text
    assert _parse([text]) == ("", WANT)


def test_template_speaks_lfm2():
    with open_gguf(path("lfm2")) as g:
        assert detect_format(g.metadata["tokenizer.chat_template"]) is LFM2


PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("lfm2")
    with serve_process(["-m", str(path("lfm2")), "--ctx-size", "1024"], d) as (url, _):
        yield url


def _chat(base, **kw):
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 80, **kw}
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    return client.chat.completions.create(model="lfm2", **kw)


@pytest.mark.slow
def test_forced_call_through_a_real_server(base):
    """Random weights: only a forced call says something. The grammar writes the JSON form in
    LFM2's markers (control tokens, kept in the text for the parser); it comes back as
    `tool_calls`, streamed or not, and its history (the pythonic form, as LFM2's template shows
    no tool_calls) goes back through the template with the result."""
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
    result = {"role": "tool", "tool_call_id": call.id, "content": "4 C"}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    again = _chat(base, messages=history, tools=[WEATHER], max_tokens=4)
    assert again.usage.prompt_tokens > resp.usage.prompt_tokens
