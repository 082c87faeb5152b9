"""Fill-in-the-middle: which tokens a model uses for FIM, and the prompt ids in PSM order.

The ids come from GGUF metadata (`tokenizer.ggml.fim_*_token_id`, or the older
`prefix/suffix/middle` keys) and, when those are absent, from well-known token texts
(StarCoder, Qwen, CodeLlama, DeepSeek). The prompt layout follows llama.cpp's infill:
`[BOS] [extra context] PRE prefix SUF suffix MID`.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localllm.engine.tokenizer import Tokenizer

_KEY = "tokenizer.ggml."
# Metadata key stems per role; the first present wins.
_META_KEYS = {
    "pre": ("fim_pre_token_id", "prefix_token_id"),
    "suf": ("fim_suf_token_id", "suffix_token_id"),
    "mid": ("fim_mid_token_id", "middle_token_id"),
    "pad": ("fim_pad_token_id",),
    "rep": ("fim_rep_token_id",),
    "sep": ("fim_sep_token_id",),
}
# Token texts by family: (pre, suf, mid, pad, rep, sep); None where the family has no such token.
_FAMILIES: tuple[tuple[str | None, ...], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
     "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<repo_name>", "<file_sep>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", "<fim-pad>", None, None),
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None, None),
    ("<PRE>", "<SUF>", "<MID>", None, None, None),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None),
)  # fmt: skip
# What llama.cpp puts after the repo token when the model has one.
REPO_NAME = "myproject"


class FimUnsupportedError(ValueError):
    """The model has no fill-in-the-middle tokens."""


@dataclass(frozen=True, slots=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None  # repository-name marker (multi-file context)
    sep: int | None = None  # file separator (multi-file context)


@dataclass(frozen=True, slots=True)
class FimChunk:
    """One extra file given as context (llama-server's `input_extra` item)."""

    filename: str
    text: str


def find_fim_tokens(meta: Mapping[str, Any], token_to_id: Mapping[str, int]) -> FimTokens | None:
    """The model's FIM tokens, or None when it has no prefix/suffix/middle triple."""
    ids: dict[str, int | None] = {}
    for role, keys in _META_KEYS.items():
        found = [meta[_KEY + k] for k in keys if isinstance(meta.get(_KEY + k), int)]
        ids[role] = found[0] if found and found[0] >= 0 else None
    if None in (ids["pre"], ids["suf"], ids["mid"]):
        for family in _FAMILIES:
            if all(t in token_to_id for t in family[:3]):
                texts = dict(zip(_META_KEYS, family, strict=True))
                ids = {r: token_to_id.get(t) if t else None for r, t in texts.items()}
                break
        else:
            return None
    for role in ("pad", "rep", "sep"):  # the metadata keys win over the texts
        keys = _META_KEYS[role]
        found = [meta[_KEY + k] for k in keys if isinstance(meta.get(_KEY + k), int)]
        if found and found[0] >= 0:
            ids[role] = found[0]
    return FimTokens(**ids)  # type: ignore[arg-type]


def fim_tokens_for(meta: Mapping[str, Any], tokenizer: Tokenizer) -> FimTokens | None:
    """`find_fim_tokens` with ids outside the vocabulary dropped (a broken file has none)."""
    fim = find_fim_tokens(meta, tokenizer.vocab.token_to_id)
    n = tokenizer.vocab_size
    if fim is None or not all(0 <= t < n for t in (fim.pre, fim.suf, fim.mid)):
        return None
    return fim


def fim_prompt(
    tokenizer: Tokenizer,
    fim: FimTokens,
    prefix: str,
    suffix: str,
    *,
    prompt: str = "",
    extra: Sequence[FimChunk] = (),
    max_tokens: int | None = None,
) -> list[int]:
    """Prompt ids in PSM order: `[BOS] [extra] PRE prefix+prompt SUF suffix MID`.

    User text is tokenized with special tokens off, so code cannot inject control tokens. When
    `max_tokens` is given and the prompt is longer, the prefix keeps its end and the suffix its
    start, in llama.cpp's 3:1 ratio.
    """

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special=False, parse_special=False)

    head: list[int] = []
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        head.append(tokenizer.bos_id)
    if fim.rep is not None and fim.sep is not None and extra:
        head += [fim.rep, *enc(REPO_NAME + "\n")]
    for chunk in extra:
        if fim.sep is not None:
            head += [fim.sep, *enc(chunk.filename + "\n")]
        else:  # llama.cpp's plain-text separator for models without a file token
            head += enc("\n\n--- snippet ---\n\n")
        head += enc(chunk.text)
    if fim.sep is not None and extra:
        head += [fim.sep, *enc("filename\n")]
    pre, suf = enc(prefix) + enc(prompt), enc(suffix)
    if max_tokens is not None:
        room = max_tokens - len(head) - 3
        if room < 2:
            raise ValueError(f"the infill context alone needs {len(head) + 3} tokens")
        if len(pre) + len(suf) > room:
            keep_suf = min(len(suf), room // 4)
            keep_pre = min(len(pre), room - keep_suf)
            keep_suf = min(len(suf), room - keep_pre)
            pre, suf = pre[len(pre) - keep_pre :], suf[:keep_suf]
    return [*head, fim.pre, *pre, fim.suf, *suf, fim.mid]
