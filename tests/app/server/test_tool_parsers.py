"""Tool-call parsers (Hermes, Llama 3, Mistral) and the `<think>` split, whole and streamed.

Streaming must not depend on where the text is cut: every output is re-fed split at every pair of
boundaries and must give exactly the whole-text result.
"""

import json

import pytest

from localllm.app.server.chat_output import ChoiceOutput, OutputPlan
from localllm.app.server.reasoning import ReasoningParser, opens_thinking
from localllm.app.server.tool_parsers import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ArgsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    apply_events,
    detect_format,
    parse_tool_calls,
)
from localllm.app.server.tool_prompt import TemplateTraits, call_text, pick_tools, prompt_messages


def _ids():
    n = iter(range(100))
    return lambda: f"id{next(n)}"


def _calls(parsed):
    return [(c.id, c.name, json.loads(c.arguments)) for c in parsed.calls]


CASES = [
    # (format, text, expected content, expected [(name, args)])
    (HERMES,
     'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"n": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>{"name":"b","arguments":{}}</tool_call>',
     "Sure.\n", [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]}), ("b", {})]),
    (HERMES, '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call> ok', " ok",
     [("f", {"a": 1})]),  # key order the header reader does not expect: whole-JSON fallback
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"x\\"}"}</tool_call>', "",
     [("f", {"a": "x"})]),  # arguments as a JSON string
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"x": 1}), ("g", {})]),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}', "", [("f", {"q": "a;b"})]),
    (LLAMA3, '{"name": "f", "parameters": {}}; done', "done", [("f", {})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}, 7]', "7]", [("f", {})]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, '
     '{"name": "g", "arguments": {"y": "]"}}]', "", [("f", {"x": 1}), ("g", {"y": "]"})]),
    (MISTRAL, 'hi[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[CALL_ID]abc123def[ARGS]{}', "hi",
     [("f", {"x": 1}), ("g", {})]),
]  # fmt: skip

MALFORMED = [
    (HERMES, 'x<tool_call>{"name": bad json}</tool_call>y'),
    (HERMES, "x<tool_call>not json at all</tool_call>"),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut: the call is kept, partial
    (LLAMA3, '  {"answer": 42}'),
    (LLAMA3, "{not json"),
    (MISTRAL, "[TOOL_CALLS] what?"),
    (MISTRAL, "[TOOL_CALLS][1, 2]"),
    (HERMES, "a < b <tool <tool_cal"),
    (HERMES, '<tool_call>{"name": "f", "arguments": null}</tool_call>'),
    (MISTRAL, "[TOOL_CALLS]f[ARGS]42"),
]


def _split_runs(fmt, text):
    """(content, calls) for `text` fed in three pieces, for every pair of cut points."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = ToolCallParser(fmt, _ids())
            events = p.feed(text[:i]) + p.feed(text[i:j]) + p.feed(text[j:]) + p.finish()
            content, calls = [], []
            apply_events(events, content, calls)
            yield (i, j), "".join(content), [(c.id, c.name, c.arguments) for c in calls], events


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_text_calls_and_content(fmt, text, content, calls):
    parsed = parse_tool_calls(text, fmt, _ids())
    assert parsed.content == content
    assert _calls(parsed) == [(f"id{i}", n, a) for i, (n, a) in enumerate(calls)]


@pytest.mark.parametrize(("fmt", "text"), [(c[0], c[1]) for c in CASES] + MALFORMED)
def test_stream_split_anywhere_gives_the_whole_text_result(fmt, text):
    whole = parse_tool_calls(text, fmt, _ids())
    want = (whole.content, [(c.id, c.name, c.arguments) for c in whole.calls])
    for cut, content, calls, events in _split_runs(fmt, text):
        assert (content, calls) == want, cut
        # Streaming order: a call's start comes before any of its argument pieces.
        started = set()
        for e in events:
            if isinstance(e, CallStart):
                started.add(e.index)
            elif isinstance(e, ArgsDelta):
                assert e.index in started


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_blocks_fall_back_to_content(fmt, text):
    parsed = parse_tool_calls(text, fmt, _ids())
    if text.endswith('{"a": 1'):  # a started call cut short keeps its piece
        assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"a": 1')]
        assert parsed.content == ""
    else:
        assert parsed.calls == [] and parsed.content == text


def test_arguments_stream_in_pieces_after_the_name():
    text = '<tool_call>{"name": "f", "arguments": {"city": "Paris"}}</tool_call>'
    p = ToolCallParser(HERMES, _ids())
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    assert events[0] == CallStart(0, "id0", "f")
    pieces = [e.text for e in events[1:]]
    assert len(pieces) > 5 and "".join(pieces) == '{"city": "Paris"}'
    assert all(isinstance(e, ArgsDelta) for e in events[1:])


def test_text_before_a_marker_streams_before_the_call_ends():
    p = ToolCallParser(HERMES, _ids())
    assert p.feed("Hello <tool") == [ContentDelta("Hello ")]  # "<tool" may open a tag: held
    assert p.feed("box> world") == [ContentDelta("<toolbox> world")]


def test_format_detection_from_template_markers():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("{{ '<|python_tag|>' }}") is LLAMA3
    assert detect_format("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert detect_format(None) is HERMES


def test_call_text_round_trips_through_each_parser():
    for fmt in (HERMES, LLAMA3, MISTRAL):
        text = call_text(fmt, [("f", {"a": 1}), ("g", {"b": [2]})])
        assert _calls(parse_tool_calls(text, fmt, _ids())) == [
            ("id0", "f", {"a": 1}), ("id1", "g", {"b": [2]})]  # fmt: skip


def test_history_without_template_support_becomes_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    msgs, template_tools = prompt_messages(history, tools, TemplateTraits.of(None), HERMES)
    assert template_tools is None
    assert msgs[0]["role"] == "system" and '"name": "f"' in msgs[0]["content"]
    assert msgs[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    }
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nf: 42\n</tool_response>"}
    # A template that knows tools gets them, and the arguments as an object.
    src = "{{ tools }}{{ message.tool_calls }}{% if message.role == 'tool' %}{% endif %}"
    msgs, template_tools = prompt_messages(history, tools, TemplateTraits.of(src), HERMES)
    assert template_tools == tools and msgs[0] == history[0]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[2] == history[2]


def test_tool_choice_picks():
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    assert pick_tools(tools, "auto") == (tools, False)
    assert pick_tools(tools, "none") == ([], False)
    assert pick_tools(tools, "required") == (tools, True)
    assert pick_tools(tools, {"type": "function", "function": {"name": "b"}}) == ([tools[1]], True)
    with pytest.raises(ValueError, match="'c'"):
        pick_tools(tools, {"type": "function", "function": {"name": "c"}})


THINK = [
    (False, "<think>\nplan it\n</think>\n\nThe answer.", "\nplan it\n", "The answer."),
    (True, "plan</think>answer", "plan", "answer"),  # the template opened the block
    (False, "no thinking here", "", "no thinking here"),
    (False, "  <thin", "", "  <thin"),  # a cut-off tag is just text
    (True, "never closed", "never closed", ""),
]


@pytest.mark.parametrize(("in_think", "text", "reasoning", "content"), THINK)
def test_think_split_at_every_cut(in_think, text, reasoning, content):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = ReasoningParser(in_think)
            parts = [p.feed(text[:i]), p.feed(text[i:j]), p.feed(text[j:]), p.finish()]
            assert "".join(s.reasoning for s in parts) == reasoning, (i, j)
            assert "".join(s.content for s in parts) == content, (i, j)


def test_prompt_tail_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_choice_output_reasoning_then_tool_call_stream_equals_message():
    text = (
        '<think>need weather</think><tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>'
    )
    co = ChoiceOutput(OutputPlan(reasoning=True, tools=HERMES))
    deltas = [d for ch in text for d in co.feed(ch)] + co.finish()
    msg = co.message()
    assert msg["reasoning_content"] == "need weather" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c": "P"}'}
    assert co.finish_reason("stop") == "tool_calls" and co.finish_reason("length") == "length"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", ()))
    assert args == '{"c": "P"}'


# -- GLM-4.5 / 4.6 / 4.7 (XML-ish arguments) ------------------------------------------------

GLM_PARAMS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
    "search": {"type": "object", "properties": {"q": {"type": "string"}, "opts": {}}},
}
GLM_CASES = [
    # (text, content, [(name, args)]) with GLM_PARAMS typing the values
    ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York"
     "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
     "Let me check.\n", [("get_weather", {"city": "New York", "days": 2})]),
    # GLM-4.7: no newlines; a string parameter keeps digits as text; two calls
    ("<tool_call>search<arg_key>q</arg_key><arg_value>42</arg_value><arg_key>opts</arg_key>"
     '<arg_value>{"n": [1, "<x>"]}</arg_value></tool_call>\n<tool_call>get_weather</tool_call>',
     "\n", [("search", {"q": "42", "opts": {"n": [1, "<x>"]}}), ("get_weather", {})]),
    # spaces as a real GLM-4.5-Air output had them; an unknown tool: values as JSON or text
    ("<tool_call>ls <arg_key>dirPath</arg_key> <arg_value>backend</arg_value> "
     "<arg_key>n</arg_key><arg_value>3</arg_value> </tool_call> ok",
     " ok", [("ls", {"dirPath": "backend", "n": 3})]),
    # a JSON body in GLM's tags (a Hermes-style writer) is a call too
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "",
     [("search", {"q": "x"})]),
    # text between the pairs is skipped; a key without a value is dropped
    ("<tool_call>search\n<arg_key>q</arg_key>oops\n<arg_key>opts</arg_key><arg_value>true"
     "</arg_value>\n</tool_call>", "", [("search", {"opts": True})]),
]  # fmt: skip
GLM_MALFORMED = [
    "a <tool_call> is how calls start",  # a name cannot have spaces then text
    "<tool_call>get_weather",  # never reaches a tag
    "x <tool_call>f <b>bold</b>",
    "<tool_call></tool_call>",  # no name
    "<tool_call>{not json}</tool_call>",
    "<tool_cal",
]


def _glm_parser():
    from localllm.app.server.glm_tools import GlmToolParser

    return GlmToolParser(GLM_PARAMS, _ids())


def _glm_parse(text):
    p = _glm_parser()
    content, calls = [], []
    apply_events(p.feed(text) + p.finish(), content, calls)
    return "".join(content), [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), GLM_CASES)
def test_glm_calls_and_content(text, content, calls):
    assert _glm_parse(text) == (content, calls)


@pytest.mark.parametrize("text", [c[0] for c in GLM_CASES] + GLM_MALFORMED)
def test_glm_stream_split_anywhere_gives_the_whole_text_result(text):
    whole = _glm_parse(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = _glm_parser()
            events = p.feed(text[:i]) + p.feed(text[i:j]) + p.feed(text[j:]) + p.finish()
            content, calls = [], []
            apply_events(events, content, calls)
            got = ("".join(content), [(c.name, json.loads(c.arguments)) for c in calls])
            assert got == whole, (i, j)
            started = set()
            for e in events:
                if isinstance(e, CallStart):
                    started.add(e.index)
                elif isinstance(e, ArgsDelta):
                    assert e.index in started


@pytest.mark.parametrize("text", GLM_MALFORMED)
def test_glm_blocks_that_are_no_calls_stay_text(text):
    assert _glm_parse(text) == (text, [])


def test_glm_call_cut_short_keeps_its_whole_pairs():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_k"
    assert _glm_parse(text) == ("", [("get_weather", {"city": "Oslo"})])


def test_glm_values_typed_by_schema_or_as_json():
    from localllm.app.server.glm_tools import typed_value

    assert typed_value("42", {"type": "string"}) == "42"
    assert typed_value("42", {"type": "integer"}) == 42
    assert typed_value("42", None) == 42 and typed_value("Paris", None) == "Paris"
    assert typed_value('"quoted"', None) == '"quoted"'  # strings are never JSON-encoded
    assert typed_value("null", {"type": ["string", "null"]}) is None
    assert typed_value("7", {"type": ["string", "null"]}) == "7"
    assert typed_value("true", {"enum": ["true", "false"]}) == "true"
    assert typed_value("[1, 2]", {"type": "array"}) == [1, 2]


def _glm_template():
    from localllm.engine.gguf import open_gguf
    from tests.engine.family_goldens import path

    with open_gguf(path("glm4moe")) as g:
        return g.metadata["tokenizer.chat_template"]


def test_glm_template_is_detected_and_its_history_parses_back():
    """The real GLM-4.6 template (carried by the converted fixture) selects the GLM format, and an
    assistant turn with tool calls, as it renders them, parses back to the same calls."""
    from localllm.app.server.tool_parsers import GLM
    from localllm.engine.tokenizer import ChatTemplate

    source = _glm_template()
    assert detect_format(source) is GLM
    calls = [("get_weather", {"city": "San Francisco", "days": 3}), ("search", {"q": "a<b"})]
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    turn = {"role": "assistant", "content": "", "tool_calls": tool_calls}
    text = ChatTemplate(source).render(
        [{"role": "user", "content": "hi"}, turn], add_generation_prompt=False
    )
    answer = text.split("<|assistant|>", 1)[1].removeprefix("\n<think></think>")
    assert _glm_parse(answer) == ("\n\n", [(n, a) for n, a in calls])  # (newlines around)
    # and our own writer gives text the parser reads back to the same calls
    from localllm.app.server.tool_prompt import call_text

    assert _glm_parse(call_text(GLM, calls)) == ("\n", [(n, a) for n, a in calls])


def test_glm_choice_output_streams_what_the_message_holds():
    from localllm.app.server.tool_parsers import GLM

    text = (
        "<think>need weather</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>1</arg_value>\n"
        "</tool_call>"
    )
    co = ChoiceOutput(OutputPlan(reasoning=True, tools=GLM, tool_params=GLM_PARAMS))
    deltas = [d for ch in text for d in co.feed(ch)] + co.finish()
    msg = co.message()
    assert msg["reasoning_content"] == "need weather" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 1}
    assert co.finish_reason("stop") == "tool_calls"
    args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", ()))
    assert args == msg["tool_calls"][0]["function"]["arguments"]
