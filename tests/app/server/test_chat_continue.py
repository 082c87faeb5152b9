"""A trailing assistant message is continued (llama-server's prefill, vLLM's
`continue_final_message`): the chat answer equals a plain completion of the prompt cut inside
that message. Before, the message was closed and a new turn opened (the field was ignored).
"""

import httpx
import pytest

from localllm.engine.gguf import open_gguf
from localllm.engine.tokenizer import ChatTemplate, Tokenizer
from localllm.engine.tokenizer.continuation import continued_render

pytestmark = pytest.mark.slow

BEGUN = [
    {"role": "user", "content": "Name the capital of France in one sentence."},
    {"role": "assistant", "content": "The capital of France is"},
]


@pytest.fixture(scope="module")
def template(smollm2_path) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(
        Tokenizer.from_gguf_metadata(open_gguf(smollm2_path).metadata)
    )


def _chat(server, **extra) -> dict:
    body = {"messages": BEGUN, "max_tokens": 8, "temperature": 0, **extra}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(server, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_trailing_assistant_message_is_continued(roomy_server, template):
    want = _complete(roomy_server, continued_render(template, BEGUN))
    for extra in ({}, {"continue_final_message": True}):
        got = _chat(roomy_server, **extra)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


def test_continue_final_message_false_answers_in_a_new_turn(roomy_server, template):
    closed = template.render(BEGUN, add_generation_prompt=True)
    want = _complete(roomy_server, closed)
    for extra in ({"continue_final_message": False}, {"add_generation_prompt": True}):
        got = _chat(roomy_server, **extra)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
