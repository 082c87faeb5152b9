"""gpt-oss's harmony output read into reasoning, content and tool calls, whole and streamed.

The outputs are what gpt-oss writes after its prompt's `<|start|>assistant`: the ones from
openai/harmony's docs/format.md, and ones rendered by the real gpt-oss chat template
(tests/data/templates/gpt-oss-120b.jinja, llama.cpp's models/templates copy) from assistant turns
with known thinking, content and calls, so what is parsed back must be those.
"""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import llguidance
import openai
import pytest

from localllm.app.server.app import create_app
from localllm.app.server.chat_output import ChoiceOutput, OutputPlan
from localllm.app.server.harmony import (
    HarmonyParser,
    ReasoningDelta,
    call_grammar,
    opens_harmony,
)
from localllm.app.server.settings import ServerSettings
from localllm.app.server.tool_parsers import (
    HARMONY,
    HERMES,
    ArgsDelta,
    CallStart,
    ContentDelta,
    detect_format,
)
from localllm.app.server.tool_prompt import TemplateTraits
from localllm.engine.tokenizer.chat_template import ChatTemplate
from tests.app.server.test_reasoning import CharTokenizer, ScriptedEngine

TEMPLATE = (Path(__file__).parents[2] / "data" / "templates" / "gpt-oss-120b.jinja").read_text()
GEN_PROMPT = "<|start|>assistant"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# openai/harmony docs/format.md, "Receiving tool calls", "Preambles" and "Reasoning".
DOCS = [
    ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant'
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"location":"San Francisco"}',
     "Need to use function get_weather.", "", [("get_weather", {"location": "San Francisco"})]),
    ("<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>"
     "commentary<|message|>**Action plan**:\n1. Generate an HTML file\n---\nWill start<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json"
     '<|message|>{"template": "basic_html", "path": "index.html"}',
     "{long chain of thought}", "**Action plan**:\n1. Generate an HTML file\n---\nWill start",
     [("generate_file", {"template": "basic_html", "path": "index.html"})]),
    ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
     "answer.<|end|>\n<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
]  # fmt: skip


def _rendered_output(assistant: dict, tools=None) -> str:
    """What the real template writes for `assistant` after the generation prompt: the text the
    model produced for that turn (the closing `<|call|>` / `<|return|>` is an end-of-generation
    token, not text)."""
    t = ChatTemplate(TEMPLATE)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    before = t.render(ask, tools=tools, add_generation_prompt=True)
    after = t.render([*ask, assistant], tools=tools, add_generation_prompt=False)
    assert before.endswith(GEN_PROMPT) and after.startswith(before)
    out = after[len(before) :]
    for end in ("<|call|>", "<|return|>"):
        out = out.removesuffix(end)
    return out


RENDERED = [
    # A call with its analysis: the template writes the recipient in the role part of the header.
    ({"role": "assistant", "thinking": "The user wants the weather; call the tool.",
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
     "The user wants the weather; call the tool.", "", [("get_weather", {"city": "Oslo"})]),
    # A final answer with its analysis (the last turn renders both).
    ({"role": "assistant", "thinking": "Cold place.", "content": "It is 4 C in Oslo."},
     "Cold place.", "It is 4 C in Oslo.", []),
]  # fmt: skip


def _cases():
    for text, reasoning, content, calls in DOCS:
        yield text, reasoning, content, calls
    for msg, reasoning, content, calls in RENDERED:
        yield _rendered_output(msg, tools=[WEATHER]), reasoning, content, calls


def _fold(events):
    reasoning, content, calls = [], [], []
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append([e.name, ""])
        else:
            assert isinstance(e, ArgsDelta) and e.index == len(calls) - 1
            calls[e.index][1] += e.text
    return "".join(reasoning), "".join(content), [(n, json.loads(a)) for n, a in calls]


def test_the_gpt_oss_template_is_detected_as_harmony():
    assert detect_format(TEMPLATE) is HARMONY
    traits = TemplateTraits.of(TEMPLATE)  # it renders tools, calls and results itself
    assert traits.tools and traits.tool_calls and traits.tool_role


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), list(_cases()))
def test_channels_split_whole_and_at_every_cut(text, reasoning, content, calls):
    p = HarmonyParser(tools=True)
    assert _fold(p.feed(text) + p.finish()) == (reasoning, content, calls)
    step = max(1, len(text) // 60)  # every cut pair would be ~10^5 runs for the long ones
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            p = HarmonyParser(tools=True)
            events = p.feed(text[:i]) + p.feed(text[i:j]) + p.feed(text[j:]) + p.finish()
            assert _fold(events) == (reasoning, content, calls), (i, j)


def test_every_single_character_cut_of_a_call():
    text = _rendered_output(RENDERED[0][0], tools=[WEATHER])
    for i in range(len(text) + 1):
        p = HarmonyParser(tools=True)
        assert _fold(p.feed(text[:i]) + p.feed(text[i:]) + p.finish()) == RENDERED[0][1:], i


def test_without_tools_calls_and_builtin_tools_are_dropped():
    text = DOCS[0][0]
    p = HarmonyParser(tools=False)
    assert _fold(p.feed(text) + p.finish()) == ("Need to use function get_weather.", "", [])
    browse = (
        '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Done."
    )
    p = HarmonyParser(tools=True)
    assert _fold(p.feed(browse) + p.finish()) == ("", "Done.", [])
    # A made-up tool result in the tool's name is not the assistant's text.
    fake = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20 C<|end|>"
    p = HarmonyParser(tools=True)
    assert _fold(p.feed(fake) + p.finish()) == ("", "", [])


def test_reasoning_none_keeps_the_analysis_message_in_the_content():
    p = HarmonyParser(tools=False, reasoning=False)
    events = p.feed(DOCS[2][0]) + p.finish()
    reasoning, content, _ = _fold(events)
    assert reasoning == ""
    assert content == (
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
        "answer.<|end|>2 + 2 = 4."
    )


def test_text_that_is_not_harmony_is_content():
    for text in ("Plain answer <|channel|> here.", "  hello", "<b>bold</b>"):
        p = HarmonyParser(tools=True)
        assert _fold(p.feed(text) + p.finish()) == ("", text, []), text
    assert opens_harmony("<|chan") is None and opens_harmony(" to") is None
    assert opens_harmony("<|channel|>final") and opens_harmony(" to=functions.f")
    assert opens_harmony("<b>") is False and opens_harmony("Hi") is False
    # A header that never reaches <|message|> within the limit is no header.
    long = "<|channel|>" + "x" * 600
    p = HarmonyParser(tools=True)
    assert _fold(p.feed(long) + p.finish()) == ("", long, [])


def test_choice_output_reads_harmony_from_the_plan_or_the_opening():
    text = _rendered_output(RENDERED[1][0])
    for plan in (OutputPlan(reasoning=True), OutputPlan(reasoning=True, harmony=True)):
        co = ChoiceOutput(plan)
        deltas = [d for ch in text for d in co.feed(ch)] + co.finish()
        assert co.message() == {
            "role": "assistant",
            "content": "It is 4 C in Oslo.",
            "reasoning_content": "Cold place.",
        }
        assert "".join(d.get("content", "") for d in deltas) == "It is 4 C in Oslo."
    # With tools on, the plan's HARMONY format parses the call; its id is a call id.
    co = ChoiceOutput(OutputPlan(reasoning=True, tools=HARMONY))
    co.feed(_rendered_output(RENDERED[0][0], tools=[WEATHER]))
    co.finish()
    msg = co.message()
    assert msg["content"] is None and msg["reasoning_content"] == RENDERED[0][1]
    call = msg["tool_calls"][0]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert co.finish_reason("stop") == "tool_calls"
    # Another family's plan is left alone.
    co = ChoiceOutput(OutputPlan(reasoning=True, tools=HERMES))
    co.feed("<|channel|>final<|message|>x")
    co.finish()
    assert co.message()["content"] == "<|channel|>final<|message|>x"


def test_call_grammar_accepts_what_the_model_is_told_to_write():
    """The forced-call grammar takes the docs' call text (markers as special tokens)."""
    specials = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"]

    class Tok:
        is_tokenizer_wrapper = True
        eos_token_id, bos_token_id = 259, None

        def __init__(self):
            self.tokens = [bytes([i]) for i in range(256)] + [s.encode() for s in specials]
            self.special_token_ids = list(range(256, 260))

        def __call__(self, text):
            return list(text if isinstance(text, bytes) else text.encode())

    lt = llguidance.LLTokenizer(Tok(), n_vocab=260, eos_token=[259])
    head = "<|channel|>commentary to=functions."
    grammar = call_grammar([WEATHER, {"type": "function", "function": {"name": "other"}}])

    def ids(text):
        out = []
        for part in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
            out += [256 + specials.index(part)] if part in specials else list(part.encode())
        return out

    good = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    )
    m = llguidance.LLMatcher(lt, llguidance.grammar_from("lark", grammar))
    assert not m.get_error()
    assert m.consume_tokens(ids(good)) and m.is_accepting()
    assert m.consume_token(259) and not m.get_error()  # then the turn may end
    for bad in (head + 'get_weather <|constrain|>json<|message|>{"c":1}',
                head + "nope <|constrain|>json<|message|>{}"):  # fmt: skip
        m = llguidance.LLMatcher(lt, llguidance.grammar_from("lark", grammar))
        assert not m.consume_tokens(ids(bad)) or not m.is_accepting()


class HarmonyTokenizer(CharTokenizer):
    def encode(self, text, **kw):
        return [ord(c) for c in text]

    def is_special(self, token_id):
        return False


class HarmonyEngine(ScriptedEngine):
    """Renders with the real gpt-oss template and answers `reply` (gpt-oss's text) in pieces.
    Grammars are not compiled here: the real-model test (test_gpt_oss_tools) does that."""

    def __init__(self, reply: str):
        super().__init__(TEMPLATE, reply)
        self.tokenizer = HarmonyTokenizer(TEMPLATE)
        self.grammars = SimpleNamespace(compile=lambda spec: None)


def _serve(reply: str, requests):
    app = create_app(HarmonyEngine(reply), ServerSettings(model_id="m"))

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        return [await r(client, http) for r in requests]

    return asyncio.run(go())


def test_chat_completions_carry_harmony_reasoning_and_calls():
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    call_msg, thinking = RENDERED[0][0], RENDERED[0][1]

    async def whole(client, _):
        return await client.chat.completions.create(model="m", messages=ask, tools=[WEATHER])

    async def streamed(client, _):
        resp = await client.chat.completions.create(
            model="m", messages=ask, tools=[WEATHER], stream=True
        )
        return [c async for c in resp]

    async def anthropic_shape(_, http):
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        body = {"model": "m", "max_tokens": 50, "messages": ask, "tools": [tool]}
        return (await http.post("/v1/messages", json=body)).json()

    resp, chunks, anth = _serve(_rendered_output(call_msg, tools=[WEATHER]),
                                [whole, streamed, anthropic_shape])  # fmt: skip
    msg = resp.choices[0].message
    assert msg.model_extra["reasoning_content"] == thinking and msg.content is None
    assert resp.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thinking
    parts = [tc for d in deltas for tc in d.tool_calls or ()]
    assert parts[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"city": "Oslo"}
    assert not any(d.content for d in deltas)
    assert [b["type"] for b in anth["content"]] == ["thinking", "tool_use"]
    assert anth["content"][0]["thinking"] == thinking and anth["stop_reason"] == "tool_use"
    assert anth["content"][1]["input"] == {"city": "Oslo"}
    # Without tools, the final channel is the answer and the analysis the reasoning.
    answer_msg, thinking, content = RENDERED[1][0], RENDERED[1][1], RENDERED[1][2]

    async def plain(client, _):
        return await client.chat.completions.create(model="m", messages=ask)

    (resp,) = _serve(_rendered_output(answer_msg), [plain])
    msg = resp.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (thinking, content)
    assert resp.choices[0].finish_reason == "stop"
