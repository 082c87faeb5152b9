"""`<think>` split into reasoning_content, through the real app.

SmolLM2 never thinks, so a scripted engine stands in: it renders with a real `ChatTemplate` and
answers with fixed text cut into small deltas. What is checked is the server's work: the split,
the opening tag taken from the template, the stream shape and `--reasoning-format none`.
"""

import asyncio
import json

import httpx
import openai

from localllm.app.server.app import create_app
from localllm.app.server.settings import ServerSettings
from localllm.engine.core.outputs import CompletionOutput, RequestOutput
from localllm.engine.tokenizer.chat_template import ChatTemplate

QWEN3_LIKE = (  # ends the prompt inside an open think block, as Qwen3 / DeepSeek-R1 do
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class CharTokenizer:
    """One id per character: decode(encode(x)) == x."""

    longest_piece = 1  # characters of the longest token (the server's context-size precheck)

    def __init__(self, template: str):
        self.chat_template = template

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(map(chr, ids))


class ScriptedEngine:
    """Renders with the real template; answers `reply` in 3-character deltas."""

    max_model_len = 4096
    alive = True

    def __init__(self, template: str, reply: str):
        self.tokenizer = CharTokenizer(template)
        self.engine = self  # `engine.engine.chat_prompt`, as on AsyncEngine
        self._template = ChatTemplate(template)
        self.reply = reply

    def chat_prompt(self, messages, tools=None, **kw) -> list[int]:
        return [ord(c) for c in self._template.render(messages, tools=tools, **kw)]

    async def chat(self, messages, params, request_id, **kw):
        prompt = self.chat_prompt(messages, tools=kw.get("tools"))
        pieces = [self.reply[i : i + 3] for i in range(0, len(self.reply), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            out = CompletionOutput(0, piece, [1], finish_reason="stop" if last else None)
            yield RequestOutput(request_id, None, prompt, [out], finished=last)
            await asyncio.sleep(0)


def _ask(template: str, reply: str, stream: bool, **settings):
    engine = ScriptedEngine(template, reply)
    app = create_app(engine, ServerSettings(model_id="m", **settings))

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        msgs = [{"role": "user", "content": "2+2?"}]
        resp = await client.chat.completions.create(model="m", messages=msgs, stream=stream)
        if not stream:
            return resp
        return [c async for c in resp]

    return asyncio.run(go())


def _streamed(chunks) -> tuple[str, str]:
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas)


def test_template_opened_think_block_goes_to_reasoning_content():
    reply = "Two and two.\nThat is 4.</think>\n\nThe answer is 4."
    msg = _ask(QWEN3_LIKE, reply, stream=False).choices[0].message
    assert msg.model_extra["reasoning_content"] == "Two and two.\nThat is 4."
    assert msg.content == "The answer is 4."
    chunks = _ask(QWEN3_LIKE, reply, stream=True)
    assert _streamed(chunks) == ("Two and two.\nThat is 4.", "The answer is 4.")
    # The reasoning streams before the answer does, not all at the end.
    kinds = [
        "r" if (c.choices[0].delta.model_extra or {}).get("reasoning_content") else "c"
        for c in chunks[1:] if c.choices and (c.choices[0].delta.content
                                            or (c.choices[0].delta.model_extra or {}).get(
                                                "reasoning_content"))
    ]  # fmt: skip
    assert kinds[0] == "r" and kinds[-1] == "c" and kinds.count("r") > 3


def test_output_opening_its_own_think_block_is_split():
    msg = _ask(PLAIN, "<think>hmm</think>4", stream=False).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == ("hmm", "4")
    # No tags, no reasoning: the plain answer is untouched.
    msg = _ask(PLAIN, "just 4 <think> here", stream=False).choices[0].message
    assert msg.content == "just 4 <think> here"
    assert "reasoning_content" not in (msg.model_extra or {})


def test_reasoning_format_none_keeps_the_tags_in_content():
    reply = "<think>hmm</think>4"
    msg = _ask(PLAIN, reply, stream=False, reasoning_format="none").choices[0].message
    assert msg.content == reply and "reasoning_content" not in (msg.model_extra or {})
    chunks = _ask(PLAIN, reply, stream=True, reasoning_format="none")
    assert _streamed(chunks) == ("", reply)


def test_messages_and_responses_carry_reasoning_in_their_own_shapes():
    engine = ScriptedEngine(QWEN3_LIKE, "Two and two.</think>It is 4.")
    app = create_app(engine, ServerSettings(model_id="m"))
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "2+2?"}]}

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        whole = (await http.post("/v1/messages", json=body)).json()
        r = await http.post("/v1/messages", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line[:6] == "data: "]
        oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        resp = await oai.responses.create(model="m", input="2+2?")
        async with oai.responses.stream(model="m", input="2+2?") as s:  # the SDK's helper
            streamed = [e async for e in s]
            final = await s.get_final_response()
        return whole, events, resp, streamed, final

    whole, events, resp, streamed, final = asyncio.run(go())
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Two and two.", "signature": ""},
        {"type": "text", "text": "It is 4."},
    ]
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]  # fmt: skip
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Two and two."
    assert "".join(d.get("text", "") for d in deltas) == "It is 4."
    assert [e["type"] for e in events if "index" in e].count("content_block_stop") == 2
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].id.startswith("rs_") and resp.output[1].id.startswith("msg_")
    assert whole["id"].startswith("msg_")
    assert resp.output[0].content[0].text == "Two and two." and resp.output_text == "It is 4."
    # Streamed, the reasoning is its own item (index 0), before the message (index 1), with the
    # ids the final response lists.
    added = [(e.output_index, e.item.type, e.item.id) for e in streamed
             if e.type == "response.output_item.added"]  # fmt: skip
    assert [a[:2] for a in added] == [(0, "reasoning"), (1, "message")]
    assert [(o.type, o.id) for o in final.output] == [a[1:] for a in added]
    kinds = [e.type for e in streamed]
    think = [e for e in streamed if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in think) == "Two and two." and len(think) > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final.output[0].content[0].text == "Two and two." and final.output_text == "It is 4."
