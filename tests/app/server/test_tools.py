"""Tool calling through the real server and the official `openai` client (SmolLM2).

SmolLM2's template knows nothing of tools, so these also cover the generic system-text path and the
text rendering of tool history. Forced choices (required / named) are grammar-constrained, so even
this 135M model emits a valid call.
"""

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from localllm.app.server.app import create_app
from localllm.app.server.settings import ServerSettings
from localllm.engine import AsyncEngine
from localllm.engine.core.outputs import CompletionOutput, RequestOutput
from localllm.engine.tokenizer.chat_template import ChatTemplate

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,  # else a tiny model invents keys until max_tokens
        },
    },
}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _check_call(call, tool):
    assert call.type == "function" and call.id
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_gives_a_valid_call_then_the_result_gets_an_answer(server):
    client = server.openai()
    resp = _chat(client, tools=[WEATHER, TIME], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = WEATHER if call.function.name == "get_weather" else TIME
    _check_call(call, tool)
    # The round trip: the call and its result go back, and the model answers in text.
    result = {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    answer = _chat(client, history, tools=[WEATHER, TIME], max_tokens=15)
    assert answer.choices[0].message.content
    # The history reached the prompt: it is longer than the question alone by the call and result.
    assert answer.usage.prompt_tokens > resp.usage.prompt_tokens + 10
    none = _chat(client, history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=15)
    assert none.choices[0].message.tool_calls is None
    # tool_choice=none leaves the tool list out of the prompt.
    assert none.usage.prompt_tokens < answer.usage.prompt_tokens


def test_named_choice_calls_that_tool(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = _chat(server.openai(), tools=[WEATHER, TIME], tool_choice=named)
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_call(calls[0], TIME)


def test_streamed_call_deltas_reassemble_to_the_same_call(server):
    client = server.openai()
    kw = dict(tools=[WEATHER], tool_choice="required")
    whole = _chat(client, **kw).choices[0].message.tool_calls[0]
    chunks = list(_chat(client, stream=True, **kw))
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert parts[0].index == 0 and parts[0].id and parts[0].function.name == "get_weather"
    assert all(p.index == 0 and p.function.name is None for p in parts[1:])
    assert len(parts) > 2  # the arguments arrive in pieces, after the name
    args = "".join(p.function.arguments or "" for p in parts)
    assert json.loads(args) == json.loads(whole.function.arguments)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_puts_the_tools_in_the_prompt_and_parses_what_comes(server):
    client = server.openai()
    plain = _chat(client, max_tokens=20)
    auto = _chat(client, tools=[WEATHER], tool_choice="auto", max_tokens=20)
    # The generic system text describing the tools is in the prompt (SmolLM2 has no tool
    # template), so the prompt grows by about its size.
    text = json.dumps(WEATHER["function"])
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + len(text) // 8
    msg = auto.choices[0].message
    if msg.tool_calls:  # whatever the model chose, a call is well formed
        _check_call(msg.tool_calls[0], WEATHER)
        assert auto.choices[0].finish_reason == "tool_calls"
    else:
        assert msg.content and auto.choices[0].finish_reason in ("stop", "length")


def test_bad_tools_are_400(server):
    client = server.openai()
    bad_schema = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
        },
    }
    cases = [
        dict(tools={"type": "function"}),  # not a list
        dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
        dict(tools=[bad_schema]),
        dict(tools=[bad_schema], tool_choice="required"),
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),  # no tools at all
        dict(tools=[WEATHER], tool_choice="sometimes"),
    ]  # fmt: skip
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, **kw)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "invalid_request_error", kw
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, tools=[bad_schema], stream=True)
    assert e.value.body["message"].startswith("tools: a function's parameters do not compile")
    assert _chat(client, max_tokens=3).choices[0].message.content  # the server still serves


@pytest.fixture(scope="module")
def engine(smollm2_path):
    eng = AsyncEngine.from_model(str(smollm2_path), max_model_len=1024, max_num_seqs=2)
    yield eng
    eng.shutdown()


def _in_process(engine, tool_format: str, **kw):
    """A chat request to an in-process app over `engine` that speaks `tool_format`."""
    app = create_app(engine, ServerSettings(model_id="m", tool_format=tool_format))

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        resp = await client.chat.completions.create(
            model="m", messages=ASK, temperature=0, max_tokens=60, **kw
        )
        return [c async for c in resp] if kw.get("stream") else resp

    return asyncio.run(go())


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_each_family_format_is_forced_and_parsed_back(engine, fmt):
    """The grammar writes the family's format; that family's parser reads it back."""
    kw = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=True)
    resp = _in_process(engine, fmt, **kw)
    calls = resp.choices[0].message.tool_calls
    assert calls and resp.choices[0].message.content is None
    args = [_check_call(c, WEATHER) for c in calls]
    if fmt == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # Mistral templates insist
    chunks = _in_process(engine, fmt, stream=True, **kw)
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    streamed: dict[int, str] = {}
    for p in parts:
        streamed[p.index] = streamed.get(p.index, "") + (p.function.arguments or "")
    assert [json.loads(streamed[i]) for i in sorted(streamed)] == args


QWEN_LIKE = (  # renders `tools`, assistant `tool_calls` and `tool` results itself, as Qwen2.5 does
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ToolTemplateEngine:
    """Renders with a real tool-aware template, keeps each prompt, answers `reply`."""

    max_model_len = 4096
    alive = True

    def __init__(self, reply: str):
        # `<tool_call>` is plain text here (several tokens), as in SmolLM2's vocabulary.
        self.tokenizer = SimpleNamespace(
            chat_template=QWEN_LIKE, encode=lambda t, **kw: [1, 2], longest_piece=16
        )
        self.engine = SimpleNamespace(grammars=SimpleNamespace(compile=lambda spec: None))
        self.template = ChatTemplate(QWEN_LIKE)
        self.reply, self.prompts = reply, []

    async def chat(self, messages, params, request_id, *, tools=None, **kw):
        prompt = self.template.render(messages, tools=tools)
        self.prompts.append(prompt)
        out = CompletionOutput(0, self.reply, [1], finish_reason="stop")
        yield RequestOutput(request_id, None, [1] * len(prompt), [out], finished=True)


def test_a_tool_aware_template_renders_tools_and_history_itself():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    engine = ToolTemplateEngine("Let me check. " + call + "\n</tool_call>")
    app = create_app(engine, ServerSettings(model_id="m"))

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        first = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
        msg = first.choices[0].message
        result = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "4 C"}
        history = [*ASK, msg.model_dump(exclude_none=True), result]
        await client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
        return first

    first = asyncio.run(go())
    msg = first.choices[0].message
    assert msg.content == "Let me check. " and first.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo", "unit": "celsius"}
    # The template got the tools (no generic system text) and, next turn, the call as an object.
    assert f"<tools>{json.dumps(WEATHER, ensure_ascii=False)}</tools>" in engine.prompts[0]
    assert "You can call the following tools" not in engine.prompts[0]
    rendered = engine.prompts[1].split("<tool_call>")[1].split("</tool_call>")[0]
    fn = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
    assert json.loads(rendered) == fn  # an object for the template, not JSON text in a string
    assert "<tool_response>\n4 C\n</tool_response>" in engine.prompts[1]
