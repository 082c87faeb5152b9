"""Anthropic /v1/messages through the real server and the official `anthropic` client."""

import anthropic
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Recent `anthropic` clients dropped the sampling arguments from create(); the API takes them.
GREEDY = {"temperature": 0}
PROMPT = "Write a short poem about the sea."


def _client(server, key=None):
    key = key or server.headers["Authorization"].removeprefix("Bearer ")  # sent as x-api-key
    return anthropic.Anthropic(base_url=server.base, api_key=key, max_retries=0)


def _chat(server, messages, max_tokens, **kw):
    resp = server.openai().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )
    return resp.choices[0], resp.usage


def test_message_answers_as_chat_does(server):
    msg = _client(server).messages.create(
        model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    )  # fmt: skip
    choice, usage = _chat(server, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": PROMPT}], 12)  # fmt: skip
    assert msg.type == "message" and msg.role == "assistant" and msg.model == server.model_id
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == choice.message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.input_tokens == usage.prompt_tokens and msg.usage.output_tokens == 12


def test_stop_sequences_and_top_k(server):
    client = _client(server)
    full = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    text = full.content[0].text
    word = text.split()[3]
    cut = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY,
                                 stop_sequences=[word, "zzzz"],
                                 messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]
    # top_k=1 samples the most likely token only: greedy, whatever the temperature.
    k1 = client.messages.create(model=MODEL, max_tokens=20,
                                extra_body={"temperature": 1.0, "top_k": 1},
                                messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    assert k1.content[0].text == text
    done = client.messages.create(model=MODEL, max_tokens=300, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Say hi."}])  # fmt: skip
    assert done.stop_reason == "end_turn"


def test_stream_events_and_text(server):
    client = _client(server)
    kw = dict(model=MODEL, max_tokens=10, extra_body=GREEDY,
              messages=[{"role": "user", "content": PROMPT}])  # fmt: skip
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    raw = [k for k in kinds if k not in ("text",)]  # the helper adds "text" convenience events
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 2 and all(e.delta.type == "text_delta" for e in deltas)
    assert "".join(e.delta.text for e in deltas) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    # The raw frames carry the ping after the first block opens.
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True}
    with server.http().stream("POST", "/v1/messages", json=body) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-1] == "message_stop"


def test_x_api_key_is_checked_and_bad_input_is_400(server):
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, "wrong").messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    client = _client(server)
    bad = [dict(max_tokens=0, messages=[{"role": "user", "content": "hi"}]),
           dict(max_tokens=3, messages=[]),
           dict(max_tokens=3, messages=[{"role": "user", "content": [{"type": "image"}]}]),
           dict(max_tokens=3, messages=[{"role": "system", "content": "hi"}]),
           dict(max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                tools=[{"name": "f", "input_schema": {"type": "object"}}])]  # fmt: skip
    for kw in bad:
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, **kw)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=3,
                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip
