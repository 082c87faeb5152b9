"""`Tokenizer`: text <-> token ids for a GGUF model, matching llama.cpp token for token.

Construction only reads and checks the metadata. The encoder (a `tokenizers` BPE model over the full
vocabulary, with merges derived from scores for SentencePiece vocabularies) and the table of token
bytes are built on first use, once, under a lock: that work takes a few tenths of a second for a
262k vocabulary and a process that only inspects a model should not pay it. Call `warm_up()` to pay
it at a time of your choosing (e.g. in a thread while weights load).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from localllm.engine.tokenizer.attrs import Attr
from localllm.engine.tokenizer.backend import Encoder
from localllm.engine.tokenizer.pieces import build_pieces
from localllm.engine.tokenizer.vocab import Vocab

# Tokens that render as nothing when special tokens are skipped (llama.cpp's `special=False`).
_HIDDEN = int(Attr.CONTROL | Attr.UNKNOWN)


class Tokenizer:
    """A GGUF model's tokenizer. Thread-safe; immutable once built."""

    def __init__(self, vocab: Vocab, encoder: Any = None) -> None:
        """`encoder`: one with `encode(text, parse_special)` to use instead of building the
        GGUF one from the vocabulary (a Hugging Face folder's `tokenizer.json`)."""
        self._vocab = vocab
        self._lock = threading.Lock()
        self._encoder: Encoder | None = encoder
        self._pieces: list[bytes] | None = None
        self._longest: int | None = None
        self._hidden = (vocab.attrs & _HIDDEN) != 0

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict (as `open_gguf(path).metadata` returns it)."""
        return cls(Vocab.from_metadata(meta))

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike, n_vocab: int) -> Tokenizer:
        """Build from a Hugging Face folder's tokenizer files (`hf_json`) for a model whose
        embedding has `n_vocab` rows."""
        from localllm.engine.tokenizer.hf_json import hf_vocab

        vocab, encoder = hf_vocab(Path(folder), n_vocab)
        return cls(vocab, encoder)

    # -- properties -------------------------------------------------------------------------------

    @property
    def vocab(self) -> Vocab:
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return self._vocab.size

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation: EOS, EOT, EOM and llama.cpp's named end tokens."""
        return self._vocab.eog_ids

    @property
    def chat_template(self) -> str | None:
        return self._vocab.chat_template

    @property
    def add_bos(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self._vocab.add_eos

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the GGUF (with `▁` or byte-level characters)."""
        self._check([token_id])
        return self._vocab.tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token: hidden by `decode(..., skip_special=True)`."""
        self._check([token_id])
        return bool(self._hidden[token_id])

    # -- encoding ---------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Build the encoder and the piece table now instead of on first use."""
        self._get_encoder()
        self._get_pieces()

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        add_special: prepend BOS / append EOS where the model's metadata asks for them.
        parse_special: recognise control tokens written in the text (`<|im_start|>`); when False
        they are tokenized as plain text. User-defined tokens are recognised either way.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, not {type(text).__name__}")
        v = self._vocab
        ids = self._get_encoder().encode(text, parse_special) if text else []
        if add_special:
            if v.add_bos and v.bos_id is not None:
                ids.insert(0, v.bos_id)
            if v.add_eos and v.eos_id is not None:
                ids.append(v.eos_id)
        return ids

    # -- decoding ---------------------------------------------------------------------------------

    @property
    def longest_piece(self) -> int:
        """Bytes of the longest token: a prompt of `c` characters is at least `c / longest_piece`
        tokens, which lets a server refuse an oversized prompt before tokenizing it."""
        if self._longest is None:
            self._longest = max(map(len, self._get_pieces()), default=1) or 1
        return self._longest

    def piece(self, token_id: int) -> bytes:
        """The raw bytes of one token (llama.cpp's `token_to_piece(special=True)`)."""
        self._check([token_id])
        return self._get_pieces()[token_id]

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """The bytes of a sequence: llama.cpp's `detokenize(remove_special=skip_special,
        unparse_special=not skip_special)` without its optional space clean-up pass."""
        ids = self._check(ids)
        strip, ids = self.leading_space_rule(ids, skip_special=skip_special)
        pieces = self._get_pieces()
        hidden = self._hidden
        if skip_special:
            chunks = [pieces[i] for i in ids if not hidden[i]]
        else:
            chunks = [pieces[i] for i in ids]
        # Only the first token loses its space prefix, and only if it is the one shown first.
        shown_first = bool(ids) and not (skip_special and hidden[ids[0]])
        if strip and shown_first and chunks[0][:1] == b" ":
            chunks[0] = chunks[0][1:]
        return b"".join(chunks)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of a sequence; invalid UTF-8 (e.g. half an emoji) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")

    def leading_space_rule(
        self, ids: Sequence[int], *, skip_special: bool
    ) -> tuple[bool, Sequence[int]]:
        """(strip one leading space from the first token?, ids without removed BOS/EOS).

        A SentencePiece vocabulary with add_space_prefix puts a space before the text; llama.cpp
        removes it again from the first token it decodes, except when it first drops a leading BOS
        (skip_special), in which case the space stays.
        """
        v = self._vocab
        strip = v.add_space_prefix
        if skip_special and v.add_bos and ids and ids[0] == v.bos_id:
            strip = v.model == "bert"  # WordPiece has no SentencePiece quirk to mirror
            ids = ids[1:]
        if skip_special and v.add_eos and ids and ids[-1] == v.eos_id:
            ids = ids[:-1]
        return strip, ids

    # -- internals --------------------------------------------------------------------------------

    def _check(self, ids: Iterable[int]) -> list[int]:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        n = self._vocab.size
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{n - 1})")
        return ids

    def _get_encoder(self) -> Encoder:
        if self._encoder is None:
            with self._lock:
                if self._encoder is None:
                    self._encoder = Encoder(self._vocab)
        return self._encoder

    def _get_pieces(self) -> list[bytes]:
        if self._pieces is None:
            with self._lock:
                if self._pieces is None:
                    self._pieces = build_pieces(self._vocab)
        return self._pieces

    def __repr__(self) -> str:
        v = self._vocab
        return f"Tokenizer({v.model}/{v.pre}, {v.size} tokens, bos={v.bos_id}, eos={v.eos_id})"
