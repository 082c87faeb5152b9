"""Prompts with images: the chat template's image placeholders, expanded to each family's layout.

Messages carry images as `{"type": "image"}` content parts (in order). The template is asked to
render them the way Hugging Face's `apply_chat_template` does (content as typed parts: a vision
template writes its own image token, e.g. SmolVLM's `<image>`); a template that only takes text
content gets the image token written into the text instead. Each image token is then replaced by
the family's placeholder text (tiles, markers, one token per embedding), as the HF processor
does, and the tokenized prompt's image-token positions become each image's span.
"""

import re
from collections.abc import Sequence
from typing import Any

from localllm.engine.tokenizer.chat_template import ChatTemplateError


def count_images(messages: Sequence[dict], kind: str = "image") -> int:
    """How many parts of this type ("image", "video") the messages hold."""
    return sum(1 for m in messages for p in _parts(m) if p.get("type") == kind)


def render(
    engine,
    messages: Sequence[dict],
    image_token: str,
    n_images: int,
    video_token: str | None = None,
    **kw: Any,
) -> str:
    """The prompt text of `messages` with exactly one `image_token` per image part (and one
    `video_token` per video part, for families that place videos with their own token)."""
    tokens = {"image": image_token, **({"video": video_token} if video_token else {})}
    want = {k: n_images if k == "image" else count_images(messages, k) for k in tokens}
    for m in messages:
        for p in _parts(m):
            for tok in tokens.values():
                if p.get("type") == "text" and tok in str(p.get("text", "")):
                    raise ValueError(
                        f"message text contains {tok!r}, the model's image placeholder: "
                        "send images as image parts, not as text"
                    )
    typed = [{**m, "content": _parts(m)} for m in messages]
    try:
        text = engine.render_chat(typed, **kw)
        if all(text.count(tokens[k]) == want[k] for k in tokens):
            return text
    except ChatTemplateError:
        pass  # a template that concatenates content as text: the flat form below
    flat = [{**m, "content": _flatten(m, tokens)} for m in messages]
    text = engine.render_chat(flat, **kw)
    for k, tok in tokens.items():
        if text.count(tok) != want[k]:
            raise ValueError(
                f"the model's chat template kept {text.count(tok)} of {want[k]} {k} "
                f"placeholders: it cannot carry these {k}s"
            )
    return text


def expand(
    text: str, image_token: str, placeholders: Sequence[str], video_token: str | None = None
) -> str:
    """`text` with its i-th `image_token` (or `video_token`) replaced by `placeholders[i]`."""
    tokens = [image_token, *([video_token] if video_token else [])]
    pieces = re.split("|".join(re.escape(t) for t in tokens), text)
    if len(pieces) != len(placeholders) + 1:
        raise ValueError(f"{len(pieces) - 1} image placeholders for {len(placeholders)} images")
    out = [pieces[0]]
    for ph, rest in zip(placeholders, pieces[1:], strict=True):
        out += [ph, rest]
    return "".join(out)


def spans(ids: Sequence[int], token_id, counts: Sequence[int]) -> list[tuple[int, ...]]:
    """The positions of each image's embeddings: the image-token positions of `ids` (`token_id`:
    one id or a set of them), in order, `counts[i]` of them for image i."""
    ids_of = token_id if isinstance(token_id, (set, frozenset)) else {token_id}
    where = [i for i, t in enumerate(ids) if t in ids_of]
    if len(where) != sum(counts):
        raise ValueError(
            f"the prompt has {len(where)} image tokens where its images need {sum(counts)}"
        )
    out, k = [], 0
    for n in counts:
        out.append(tuple(where[k : k + n]))
        k += n
    return out


def _parts(m: dict) -> list[dict]:
    content = m.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p for p in content if isinstance(p, dict)]


def _flatten(m: dict, tokens: dict[str, str]) -> str | None:
    if m.get("content") is None:
        return None
    texts = []
    for p in _parts(m):
        if p.get("type") in tokens:
            texts.append(tokens[p["type"]])
        elif p.get("type") == "text":
            texts.append(str(p.get("text", "")))
    return "".join(texts)
