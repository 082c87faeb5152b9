"""Streaming token ids -> text without ever emitting broken UTF-8.

A token's bytes need not be whole characters: an emoji can arrive as four `<0xNN>` byte-fallback
tokens, and byte-level BPE tokens often split multi-byte characters. `IncrementalDetokenizer` keeps
the bytes of an unfinished character back until the rest arrives, and emits U+FFFD only for bytes
that can never become valid (the same replacements `bytes.decode("utf-8", "replace")` makes). Its
outputs, concatenated, equal `tokenizer.decode(all_ids)`, including the leading-space rule of
SentencePiece vocabularies and the BOS/EOS removal of `skip_special`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.engine.tokenizer.tokenizer import Tokenizer


def _incomplete_tail(data: bytes) -> int:
    """Length of a trailing, still-completable UTF-8 sequence (0 if the data ends cleanly).

    A lead byte can never continue an earlier sequence, so a decoder always starts afresh there:
    decoding up to it and from it separately gives the same text as decoding all at once.
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return 0
        if b < 0xC0:
            continue  # continuation byte: look further back for the lead
        if not 0xC2 <= b <= 0xF4:
            return 0  # never a valid lead: the decoder replaces it now
        need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
        if back >= need:
            return 0  # complete (or already invalid) sequence
        # The second byte's range depends on the lead (no overlongs, surrogates or > U+10FFFF).
        lo, hi = {
            0xE0: (0xA0, 0xBF),
            0xED: (0x80, 0x9F),
            0xF0: (0x90, 0xBF),
            0xF4: (0x80, 0x8F),
        }.get(b, (0x80, 0xBF))
        tail = data[n - back + 1 :]
        if tail and not lo <= tail[0] <= hi:
            return 0
        return back
    return 0


class IncrementalDetokenizer:
    """Feed ids one at a time (`add`), get the newly finished text; `flush()` at the end.

    prompt_ids: ids already in the sequence before the first `add` (their text is not emitted;
    a character split across the prompt's end and the first new token still comes out whole).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special: bool = False,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._pending = b""
        self._held_eos: int | None = None
        self._first = True
        self._strip = tokenizer.vocab.add_space_prefix
        if prompt_ids:
            data = tokenizer.decode_bytes(prompt_ids, skip_special=skip_special)
            self._pending = data[len(data) - _incomplete_tail(data) :]
            self._first = False

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        tok = self._tok
        tok.piece(token_id)  # validates the id before any state changes
        out = b""
        if self._held_eos is not None:  # the held EOS was not the last token after all
            out = self._render(self._held_eos)
            self._held_eos = None
        if self._skip and tok.add_eos and token_id == tok.eos_id:
            # decode(skip_special=True) drops a final EOS: hold it until we know it is final.
            self._held_eos = token_id
        else:
            out += self._render(token_id)
        return self._emit(out)

    def add_many(self, ids: Iterable[int]) -> str:
        return "".join(self.add(i) for i in ids)

    def flush(self) -> str:
        """The rest: an unfinished character becomes U+FFFD; a held final EOS is dropped."""
        self._held_eos = None
        rest, self._pending = self._pending, b""
        return rest.decode("utf-8", "replace")

    def _render(self, token_id: int) -> bytes:
        # Mirrors Tokenizer.decode_bytes, one token at a time.
        tok = self._tok
        strip = False
        if self._first:
            self._first = False
            if self._skip and tok.add_bos and token_id == tok.bos_id:
                return b""  # a leading BOS is dropped, and then no space is stripped
            strip = self._strip
        if self._skip and tok.is_special(token_id):
            return b""
        piece = tok.piece(token_id)
        return piece[1:] if strip and piece[:1] == b" " else piece

    def _emit(self, data: bytes) -> str:
        data = self._pending + data
        keep = _incomplete_tail(data)
        self._pending = data[len(data) - keep :]
        return data[: len(data) - keep].decode("utf-8", "replace")
