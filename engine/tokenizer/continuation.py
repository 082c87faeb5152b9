"""A conversation rendered so that generation continues its last message (assistant prefill).

Chat templates know only whole turns: they close every message with its end-of-turn text. To
continue the last message, render without a generation prompt and cut the text right after that
message's content, as vLLM's `continue_final_message` and llama-server's assistant prefill do.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from localllm.engine.tokenizer.chat_template import ChatTemplate, ChatTemplateError


def continued_render(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text up to the end of the last message's content, its turn left open."""
    if not messages:
        raise ChatTemplateError("there is no final message to continue")
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise ChatTemplateError("the final message to continue must have text content")
    if not content.strip():
        if messages[-1].get("role") != "assistant":
            raise ChatTemplateError("the final message to continue is empty")
        # Nothing begun: the same as a fresh assistant turn after the others.
        return template.render(
            messages[:-1], add_generation_prompt=True, tools=tools, **template_kwargs
        )
    text = template.render(messages, add_generation_prompt=False, tools=tools, **template_kwargs)
    # Templates often trim a message's content; the cut goes after what the template kept.
    for kept in (content, content.rstrip(), content.strip()):
        at = text.rfind(kept)
        if at >= 0:
            return text[: at + len(kept)]
    raise ChatTemplateError(
        "the chat template changes the final message's text, so it cannot be continued"
    )
