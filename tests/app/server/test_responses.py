"""/v1/responses through the real server and the official `openai` client (`client.responses`)."""

import json
import re

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "Write a short poem about the sea."


def _chat_text(client, messages, max_tokens):
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return resp.choices[0].message.content, resp.usage


def test_text_input_answers_as_chat_does(server):
    client = server.openai()
    resp = client.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=12)
    text, usage = _chat_text(client, [{"role": "user", "content": PROMPT}], 12)
    assert resp.object == "response"
    # OpenAI's id shapes: resp_<hex> for the response, msg_<hex> for an output message.
    assert re.fullmatch(r"resp_[0-9a-f]{48}", resp.id)
    assert re.fullmatch(r"msg_[0-9a-f]{48}", resp.output[0].id)
    assert resp.output_text == text and text
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == usage.prompt_tokens
    assert resp.usage.output_tokens == 12
    assert resp.usage.total_tokens == usage.prompt_tokens + 12
    # Cut by max_output_tokens: incomplete, as OpenAI reports it.
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"


def test_message_list_and_instructions_reach_the_template(server):
    client = server.openai()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    resp = client.responses.create(model=MODEL, input=items, instructions="Answer in French.",
                                   temperature=0, max_output_tokens=8)  # fmt: skip
    msgs = [{"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Name a color."}]  # fmt: skip
    text, usage = _chat_text(client, msgs, 8)
    assert resp.output_text == text
    assert resp.usage.input_tokens == usage.prompt_tokens
    assert resp.instructions == "Answer in French."


def test_stream_event_sequence_and_text(server):
    client = server.openai()
    whole = client.responses.create(model=MODEL, input=PROMPT, temperature=0,
                                    max_output_tokens=10)  # fmt: skip
    events = list(client.responses.create(model=MODEL, input=PROMPT, temperature=0,
                                          max_output_tokens=10, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert deltas == list(range(4, 4 + len(deltas))) and len(deltas) > 2
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(events[i].delta for i in deltas)
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert re.fullmatch(r"resp_[0-9a-f]{48}", final.id)
    item = final.output[0].id
    assert re.fullmatch(r"msg_[0-9a-f]{48}", item)
    assert events[2].item.id == item and all(events[i].item_id == item for i in deltas)


def test_natural_stop_is_completed(server):
    client = server.openai()
    events = list(client.responses.create(model=MODEL, input="Say hi.", temperature=0,
                                          max_output_tokens=200, stream=True))  # fmt: skip
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "completed"


def test_bad_input_is_400(server):
    client = server.openai()
    for kw in (dict(input=[{"type": "function_call_output", "output": "x"}]),
               dict(input=[{"role": "user", "content": [{"type": "input_image"}]}]),
               dict(input="x", temperature=-1),
               dict(input="x", tools=[{"type": "web_search"}])):  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, max_output_tokens=3, **kw)
    # Raw SSE: named events, no [DONE] frame.
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}
    with server.http().stream("POST", "/v1/responses", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created" and "data: [DONE]" not in lines
    assert json.loads(lines[1][6:])["type"] == "response.created"
