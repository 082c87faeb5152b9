"""The text -> ids machinery behind `Tokenizer.encode`: a `tokenizers` BPE model plus special-token
splitters, built from a `Vocab`.

Both vocabulary kinds become a `tokenizers` BPE model over the full vocabulary:
- `gpt2`: the file's merges, with the pre-tokenizer regexes of `tokenizer.ggml.pre` and the
  byte-level mapping.
- `llama` (SentencePiece-style): merges derived from the scores (see `spm_merges`), byte fallback to
  `<0xNN>` tokens, and no pre-tokenizer, since llama.cpp merges across the whole text fragment.
`bert` vocabularies become a `tokenizers` WordPiece model with BERT's normalizer and pre-tokenizer.
Special tokens are cut out first by our own splitter (llama.cpp's rules differ from `tokenizers`'
added-token matching), so the `tokenizers` model never sees them.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from localllm.engine.tokenizer.attrs import Attr
from localllm.engine.tokenizer.pretokenize import byte_level_pre_tokenizer, pre_tokenizer_spec
from localllm.engine.tokenizer.special import SpecialSplitter, SpecialToken
from localllm.engine.tokenizer.spm_merges import derive_merges
from localllm.engine.tokenizer.vocab import Vocab, VocabError

log = logging.getLogger(__name__)

SPECIAL_ATTRS = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)


class Encoder:
    """Encodes text to ids with llama.cpp's semantics; see `Tokenizer.encode`."""

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._spm = vocab.model == "llama"
        builder = {"llama": _build_spm, "bert": _build_wpm}.get(vocab.model, _build_bpe)
        with _gc_paused():
            try:
                self._hf = builder(vocab)
            except Exception as e:  # `tokenizers` raises plain Exception for what it refuses
                raise VocabError(f"cannot build the {vocab.model!r} tokenizer: {e}") from e
        self._batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        self._splitters: dict[bool, SpecialSplitter] = {}

    def _splitter(self, parse_special: bool) -> SpecialSplitter:
        # Built on first use: the full set (Gemma: ~6k control tokens) costs a regex compile that
        # a caller who never parses special tokens should not pay. Racing threads may both build
        # one; either result is the same.
        splitter = self._splitters.get(parse_special)
        if splitter is None:
            attrs = self._vocab.attrs
            # Without parse_special llama.cpp still cuts out user-defined tokens, not control ones.
            wanted = SPECIAL_ATTRS if parse_special else int(Attr.USER_DEFINED)
            excluded = 0 if parse_special else int(Attr.CONTROL | Attr.UNKNOWN)
            ids = np.flatnonzero(((attrs & wanted) != 0) & ((attrs & excluded) == 0)).tolist()
            tokens = self._vocab.tokens
            splitter = SpecialSplitter(
                SpecialToken(
                    tokens[i], i, bool(attrs[i] & Attr.LSTRIP), bool(attrs[i] & Attr.RSTRIP)
                )
                for i in ids
            )
            self._splitters[parse_special] = splitter
        return splitter

    def encode(self, text: str, parse_special: bool) -> list[int]:
        parts = self._splitter(parse_special).split(text)
        raw = [p for p in parts if isinstance(p, str)]
        if self._spm:
            # Every raw fragment follows a special token or starts the text, which is when llama.cpp
            # adds the space prefix; then spaces become ▁ as SentencePiece stores them.
            prefix = " " if self._vocab.add_space_prefix else ""
            raw = [(prefix + p).replace(" ", "▁") for p in raw]
        # The batch call even for one fragment: `tokenizers` lets go of the GIL only there, and a
        # long prompt (a second or more) must not freeze the server's event loop meanwhile.
        encoded = [e.ids for e in self._batch(raw, add_special_tokens=False)] if raw else []
        out: list[int] = []
        it = iter(encoded)
        for p in parts:
            if isinstance(p, str):
                out.extend(next(it))
            else:
                out.append(p)
        return out


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The build allocates about a million tuples (merges) next to a 262k-entry vocabulary: the
    cyclic collector would walk all of them again and again for nothing (none form cycles)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_spm(vocab: Vocab) -> HFTokenizer:
    scores = vocab.scores if vocab.scores is not None else np.zeros(vocab.size, np.float32)
    merges = derive_merges(vocab.tokens, scores)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    model = models.BPE(
        vocab=vocab.token_to_id, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=False
    )
    return HFTokenizer(model)


def _build_bpe(vocab: Vocab) -> HFTokenizer:
    spec = pre_tokenizer_spec(vocab.pre)
    index = vocab.token_to_id
    merges = []
    dropped = 0
    for line in vocab.merges or ():
        # llama.cpp splits at the first space after the first character.
        cut = line.find(" ", 1)
        left, right = line[:cut], line[cut + 1 :]
        if cut < 0 or left not in index or right not in index or left + right not in index:
            dropped += 1
            continue
        merges.append((left, right))
    if dropped:
        log.warning("ignored %d BPE merges whose parts or result are not tokens", dropped)
    model = models.BPE(vocab=index, merges=merges, ignore_merges=spec.ignore_merges)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = byte_level_pre_tokenizer(spec)
    return hf


def _build_wpm(vocab: Vocab) -> HFTokenizer:
    # llama.cpp's converter writes word-initial pieces as `▁word` and continuations without `##`;
    # special `[...]` tokens keep their text. Undo that to get the WordPiece vocabulary back.
    index: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        index.setdefault(_wordpiece(t), i)
    # the unknown token under its WordPiece name: `tokenizers` refuses one its vocabulary lacks
    unk = _wordpiece(vocab.tokens[vocab.unk_id]) if vocab.unk_id is not None else "[UNK]"
    if unk not in index:
        raise VocabError(f"the WordPiece vocabulary has no unknown token {unk!r}")
    hf = HFTokenizer(models.WordPiece(index, unk_token=unk, max_input_chars_per_word=100))
    # GGUF does not record do_lower_case: a vocabulary with upper-case word pieces is cased.
    cased = any(t[:1] != "[" and t.lower() != t for t in vocab.tokens)
    hf.normalizer = normalizers.BertNormalizer(lowercase=not cased)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return hf


def _wordpiece(token: str) -> str:
    """A GGUF WordPiece token under its original name: `▁word` -> `word`, a continuation
    `piece` -> `##piece`, `[SPECIAL]` as it is."""
    if token.startswith("▁"):
        return token[1:]
    if token.startswith("[") and token.endswith("]"):
        return token
    return "##" + token
