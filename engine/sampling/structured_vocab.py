"""The bridge from our GGUF `Tokenizer` to llguidance's token table (`LLTokenizer`).

llguidance masks tokens by their raw bytes, so it gets every token's bytes as llama.cpp's
`token_to_piece(special=True)` gives them (byte-level BPE characters and SentencePiece `▁` and
`<0xNN>` pieces already mapped back to bytes by `Tokenizer.piece`), padded with empty tokens up to
the model's logits width. Control tokens, and user-defined ones that look like `<name>`, are marked
special (llguidance then never allows them as text), as llama.cpp's own llguidance bridge does.
Every end-of-generation id counts as EOS, so each of them is allowed exactly when the grammar may
end.
"""

from __future__ import annotations

import llguidance
import numpy as np

from localllm.engine.tokenizer import Tokenizer
from localllm.engine.tokenizer.attrs import Attr


class TokenSource:
    """What `llguidance.LLTokenizer` reads from a Python tokenizer (its `TokenizerWrapper`
    protocol), without the wrapper's probe call that would build our encoder early."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Tokenizer, pieces: list[bytes], specials: list[int]) -> None:
        eog = sorted(tokenizer.eog_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else eog[0]
        self.bos_token_id = tokenizer.bos_id
        self.tokens = pieces
        self.special_token_ids = specials
        self._tokenizer = tokenizer
        self._specials = frozenset(specials)
        self._byte_ids = _single_byte_ids(pieces, self._specials)

    def __call__(self, text: str | bytes) -> list[int]:
        """Token ids for `text` in the middle of a sequence (llguidance uses this for forced
        tokens). A SentencePiece space prefix would add a byte, and an added token that is plain
        text to the tokenizer but special to llguidance (Qwen's `</tool_call>`) would be refused:
        then fall back to bytes."""
        # Called from inside llguidance (Rust), where an exception would be a panic: never raise.
        data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
        try:
            ids = self._tokenizer.encode(
                data.decode("utf-8", "replace"), add_special=False, parse_special=False
            )
        except Exception:
            ids = []
        if b"".join(self.tokens[i] for i in ids) == data and self._specials.isdisjoint(ids):
            return ids
        if all(b in self._byte_ids for b in data):
            return [self._byte_ids[b] for b in data]
        return ids


def _single_byte_ids(pieces: list[bytes], specials: set[int]) -> dict[int, int]:
    """byte value -> the first ordinary token that is exactly that byte."""
    out: dict[int, int] = {}
    for i, p in enumerate(pieces):
        if len(p) == 1 and i not in specials and p[0] not in out:
            out[p[0]] = i
    return out


def special_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids llguidance must treat as special (never text): control and unknown tokens, and
    user-defined tokens written like `<name>` (llama.cpp's rule)."""
    attrs = tokenizer.vocab.attrs
    hidden = np.flatnonzero(attrs & int(Attr.CONTROL | Attr.UNKNOWN)).tolist()
    texts = tokenizer.vocab.tokens
    tagged = [
        i
        for i in np.flatnonzero(attrs & int(Attr.USER_DEFINED)).tolist()
        if texts[i].startswith("<") and texts[i].endswith(">")
    ]
    return sorted({*hidden, *tagged})


def build_lltokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's token table for `tokenizer`, `vocab_size` wide (>= the tokenizer's size:
    extra logits rows are empty tokens, never allowed). Takes ~0.4 s for 49k tokens and 1-2.5 s
    for 262k (half of it llguidance's mask-speeding slices): build once per model."""
    n = tokenizer.vocab_size
    if vocab_size < n:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n} tokens")
    eog = sorted(tokenizer.eog_ids)
    if tokenizer.eos_id is not None and tokenizer.eos_id not in eog:
        eog = sorted({*eog, tokenizer.eos_id})
    if not eog:
        raise ValueError("the tokenizer has no end-of-generation token: a grammar could not end")
    pieces = [tokenizer.piece(i) for i in range(n)] + [b""] * (vocab_size - n)
    source = TokenSource(tokenizer, pieces, special_ids(tokenizer))
    return llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eog)
