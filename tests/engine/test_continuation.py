"""`continued_render`: the prompt ends inside the last message, its turn left open.

Checked against the template's own full render: the continued prompt is that render cut right
after the final message's text (what vLLM's `continue_final_message` does).
"""

import pytest

from localllm.engine.tokenizer import ChatTemplate
from localllm.engine.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplateError
from localllm.engine.tokenizer.continuation import continued_render

# Llama 3's way: contents trimmed, every turn closed by <|eot_id|>.
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SHOUTING = "{% for m in messages %}{{ m['content'] | upper }}<end>{% endfor %}"

ASK = {"role": "user", "content": "What is the capital of France?"}


def test_chatml_continues_inside_the_assistant_turn():
    t = ChatTemplate(CHATML_TEMPLATE)
    msgs = [ASK, {"role": "assistant", "content": "The capital is"}]
    text = continued_render(t, msgs)
    full = t.render(msgs, add_generation_prompt=False)
    assert full.startswith(text) and full[len(text) :] == "<|im_end|>\n"
    assert text.endswith("<|im_start|>assistant\nThe capital is")


def test_a_trimming_template_is_cut_after_the_text_it_kept():
    t = ChatTemplate(LLAMA3_LIKE, bos_token="<|begin_of_text|>")
    text = continued_render(t, [ASK, {"role": "assistant", "content": "  The capital is  "}])
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nThe capital is")


def test_an_empty_assistant_message_is_a_fresh_turn():
    t = ChatTemplate(CHATML_TEMPLATE)
    text = continued_render(t, [ASK, {"role": "assistant", "content": ""}])
    assert text == t.render([ASK], add_generation_prompt=True)


def test_a_template_that_rewrites_the_text_cannot_be_continued():
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        continued_render(ChatTemplate(SHOUTING), [ASK, {"role": "assistant", "content": "Pa"}])
    with pytest.raises(ChatTemplateError, match="text content"):
        continued_render(ChatTemplate(CHATML_TEMPLATE), [ASK, {"role": "assistant"}])
    with pytest.raises(ChatTemplateError, match="no final message"):
        continued_render(ChatTemplate(CHATML_TEMPLATE), [])
