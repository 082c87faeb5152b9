"""Turn user text into prompt token ids: raw completion, or one chat turn through the template."""

from .tokenizer import ChatTemplate, Tokenizer

# Used only when the caller asks for chat and the model ships no template.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def prompt_ids(
    tok: Tokenizer, text: str, *, chat: bool, system: str | None = None
) -> list[int]:
    """Token ids for `text`: templated as a user turn when `chat`, else a plain completion.

    Special tokens written in the text are parsed (as llama.cpp does); BOS is added per the
    model's metadata unless the rendered chat already begins with it.
    """
    if not chat:
        return tok.encode(text, add_special=True, parse_special=True)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    template = ChatTemplate(tok.chat_template or CHATML, bos_token=bos, eos_token=eos)
    rendered = template.render(messages, add_generation_prompt=True)
    add_bos = not (bos and rendered.startswith(bos))
    return tok.encode(rendered, add_special=add_bos, parse_special=True)
