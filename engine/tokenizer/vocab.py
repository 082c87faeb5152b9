"""The vocabulary as a GGUF file describes it, with llama.cpp's reading of the metadata.

`Vocab.from_metadata` turns the `tokenizer.*` keys into plain fields: token texts, scores, per-token
attribute flags, special ids and the add-BOS/EOS/space-prefix switches. Where a GGUF leaves a key
out, the default is the one llama.cpp (the reference GGUF engine) uses, so both engines see the same
tokenizer. llama.cpp also patches token attributes by name (an `<|im_end|>` stored as a normal token
is still a control token, `<unusedN>` controls are unused, ...): those rules live in
`special_names.py`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.engine.tokenizer.attrs import Attr
from localllm.engine.tokenizer.special_names import apply_name_rules

log = logging.getLogger(__name__)

KEY = "tokenizer.ggml."


# GGUF `tokenizer.ggml.token_type` values (gguf.TokenType) -> attribute.
_TYPE_TO_ATTR = {
    0: Attr.UNDEFINED,
    1: Attr.NORMAL,
    2: Attr.UNKNOWN,
    3: Attr.CONTROL,
    4: Attr.USER_DEFINED,
    5: Attr.UNUSED,
    6: Attr.BYTE,
}

# Pre-tokenizer names for which llama.cpp adds BOS unless the file says otherwise.
_PRE_ADDS_BOS = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "tekken",
        "chameleon",
    }
)

SUPPORTED_MODELS = ("gpt2", "llama", "bert")


class VocabError(ValueError):
    """The GGUF tokenizer metadata is missing, malformed or of an unsupported kind."""


@dataclass(frozen=True, eq=False)
class Vocab:
    """Everything the tokenizer needs from the GGUF metadata, already validated."""

    # "gpt2" (byte-level BPE), "llama" (SentencePiece-style, merged by score) or "bert" (WordPiece)
    model: str
    pre: str  # `tokenizer.ggml.pre`, "default" when absent
    tokens: list[str]
    scores: np.ndarray | None  # float32 per token, SentencePiece only
    attrs: np.ndarray  # int32 Attr flags per token, after llama.cpp's name rules
    merges: list[str] | None  # "left right" strings, BPE only
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @property
    def size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def token_to_id(self) -> dict[str, int]:
        """llama.cpp's text -> id map (the last duplicate wins). Built on first use: ~0.1 s for
        262k tokens, which plain metadata inspection should not pay."""
        return dict(zip(self.tokens, range(len(self.tokens)), strict=True))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Vocab:
        model = meta.get(KEY + "model")
        if model is None:
            raise VocabError("GGUF metadata has no tokenizer.ggml.model: no tokenizer in this file")
        if model not in SUPPORTED_MODELS:
            raise VocabError(
                f"unsupported tokenizer model {model!r} (supported: {SUPPORTED_MODELS})"
            )
        tokens = _string_list(meta, KEY + "tokens")
        n = len(tokens)
        if n == 0:
            raise VocabError("tokenizer.ggml.tokens is empty")
        _check_utf8(tokens)
        if model == "bert" and not any(t.startswith("▁") for t in tokens):
            # llama.cpp's converter starts every WordPiece word with ▁; without any, every word
            # would be unknown (a byte-level BPE vocabulary marks spaces with Ġ instead)
            raise VocabError(
                "tokenizer.ggml.model is 'bert' (WordPiece) but no token starts a word with '▁': "
                "not a WordPiece vocabulary"
            )
        if model == "gpt2":
            # Byte-level BPE spells every text from its byte tokens; printable ASCII maps to
            # itself there, so a vocabulary without those cannot encode plain text at all.
            missing = set(map(chr, range(33, 127))).difference(tokens)
            if missing:
                raise VocabError(
                    "tokenizer.ggml.model is 'gpt2' (byte-level BPE) but the vocabulary lacks "
                    f"{len(missing)} of the 94 printable ASCII byte tokens (e.g. "
                    f"{min(missing)!r}): not a byte-level vocabulary"
                )
        if "" in tokens:  # llama.cpp renames empty tokens so that every text maps back to one id
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        scores = _numeric(meta, KEY + "scores", n, np.float32)
        types = _numeric(meta, KEY + "token_type", n, np.int32)
        attrs = np.full(n, int(Attr.NORMAL), np.int32)
        if types is not None:
            lut = np.zeros(8, np.int32)
            for t, a in _TYPE_TO_ATTR.items():
                lut[t] = int(a)
            attrs = lut[np.clip(types, 0, 7)]  # unknown type numbers read as UNDEFINED (slot 7)
        pre = meta.get(KEY + "pre") or "default"
        spm = model == "llama"
        wpm = model == "bert"
        merges = None
        if model == "gpt2":
            merges = _string_list(meta, KEY + "merges")
        # llama.cpp defaults per vocab kind, then the file's keys win.
        defaults = (1, 2, 0) if spm else (101, 102, 100) if wpm else (11, 11, None)
        ids = {
            "bos": _special(meta, "bos_token_id", defaults[0], n),
            "eos": _special(meta, "eos_token_id", defaults[1], n),
            "unk": _special(meta, "unknown_token_id", defaults[2], n),
            "eot": _special(meta, "eot_token_id", None, n),
            "eom": _special(meta, "eom_token_id", None, n),
            "pad": _special(meta, "padding_token_id", None, n),
        }
        if wpm:
            # WordPiece wraps text as [CLS] ... [SEP] (llama.cpp always does): they play BOS/EOS.
            ids["bos"] = _special(meta, "cls_token_id", ids["bos"], n)
            ids["eos"] = _special(meta, "seperator_token_id", ids["eos"], n)
        add_bos = wpm or _flag(meta, "add_bos_token", spm or pre in _PRE_ADDS_BOS)
        add_eos = wpm or _flag(meta, "add_eos_token", False)
        # WordPiece words start with ▁ in GGUF: the first decoded word drops its space.
        add_space_prefix = _flag(meta, "add_space_prefix", spm or wpm)
        eog, ids = apply_name_rules(tokens, attrs, ids, str(meta.get("general.name", "")))
        template = meta.get("tokenizer.chat_template")
        return cls(
            model=model,
            pre=str(pre),
            tokens=tokens,
            scores=scores,
            attrs=attrs,
            merges=merges,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            eot_id=ids["eot"],
            eom_id=ids["eom"],
            unk_id=ids["unk"],
            pad_id=ids["pad"],
            eog_ids=frozenset(eog),
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            chat_template=template if isinstance(template, str) and template else None,
        )


def _string_list(meta: dict[str, Any], key: str) -> list[str]:
    value = meta.get(key)
    if value is None:
        raise VocabError(f"GGUF metadata has no {key}")
    # set(map(type, ...)) runs in C: a generator over 262k tokens would cost ~20 ms.
    if not isinstance(value, list) or not set(map(type, value)) <= {str}:
        raise VocabError(f"{key} must be an array of strings")
    return value


def _check_utf8(tokens: list[str]) -> None:
    """Token texts are UTF-8 in every vocabulary llama.cpp's converters write; invalid bytes
    (read as surrogate escapes) mean a corrupt file, and no text could ever encode to them."""
    try:
        "".join(tokens).encode("utf-8")  # one pass in C over all of them (~2 ms for 262k)
    except UnicodeEncodeError:
        for i, t in enumerate(tokens):
            if not t.isascii():
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError:
                    raw = t.encode("utf-8", "surrogateescape")
                    raise VocabError(
                        f"token {i} of tokenizer.ggml.tokens, {raw!r}, is not valid UTF-8 "
                        "(a corrupt vocabulary)"
                    ) from None


def _numeric(meta: dict[str, Any], key: str, n: int, dtype: type) -> np.ndarray | None:
    value = meta.get(key)
    if value is None:
        return None
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise VocabError(f"{key} must be a numeric array") from e
    if arr.ndim != 1 or len(arr) < n:
        raise VocabError(f"{key} has {arr.size} entries for {n} tokens")
    return arr[:n]


def _special(meta: dict[str, Any], name: str, default: int | None, n: int) -> int | None:
    if default is not None and default >= n:
        default = None
    value = meta.get(KEY + name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise VocabError(f"{KEY + name} must be an integer")
    if not 0 <= value < n:
        # llama.cpp keeps its default for an out-of-range id rather than failing the load.
        log.warning(
            "%s%s = %d is outside the vocabulary of %d tokens; ignored", KEY, name, value, n
        )
        return default
    return value


def _flag(meta: dict[str, Any], name: str, default: bool) -> bool:
    value = meta.get(KEY + name)
    if value is None:
        return default
    if type(value) is not bool and not (type(value) is int and value in (0, 1)):
        raise VocabError(f"{KEY + name} is {value!r:.40}, expected a boolean")
    return bool(value)
