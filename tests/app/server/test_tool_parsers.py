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
