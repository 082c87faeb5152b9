"""Turn user text into prompt token ids: raw completion, or one chat turn through the template."""

from localllm.engine.tokenizer import ChatTemplate, Tokenizer


def prompt_ids(tok: Tokenizer, text: str, *, chat: bool, system: str | None = None) -> list[int]:
    """Token ids for `text`: templated as a user turn when `chat`, else a plain completion.

    Special tokens written in the text are parsed (as llama.cpp does); BOS is added per the
    model's metadata unless the rendered chat already begins with it.
    """
    if not chat:
        return tok.encode(text, add_special=True, parse_special=True)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    template = ChatTemplate.for_tokenizer(tok)
    rendered = template.render(messages, add_generation_prompt=True)
    bos = template.bos_token
    add_bos = not (bos and rendered.startswith(bos))
    return tok.encode(rendered, add_special=add_bos, parse_special=True)
