"""Tokenizer behaviour on small hand-made vocabularies: metadata errors, llama.cpp's special-token
rules, the SentencePiece space prefix, pre-tokenizer fallback. No model files needed."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from localllm.engine.tokenizer import Tokenizer, VocabError
from localllm.engine.tokenizer.pieces import gpt2_byte_decoder
from localllm.engine.tokenizer.special import SpecialSplitter, SpecialToken
from localllm.engine.tokenizer.spm_merges import derive_merges

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def byte_level_meta(extra: list[tuple[str, int]] = (), merges: list[str] = (), **keys) -> dict:
    """A gpt2-style vocabulary: the 256 byte characters, then `extra` (text, type) tokens."""
    chars = sorted(gpt2_byte_decoder(), key=lambda c: gpt2_byte_decoder()[c])
    tokens = chars + [t for t, _ in extra]
    types = [NORMAL] * 256 + [k for _, k in extra]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.merges": list(merges),
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return meta


def spm_meta(add_space_prefix: bool = True) -> dict:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, byte tokens, then scored pieces."""
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "hello",
        "▁w",
        "or",
        "▁wor",
        "▁world",
        "ld",
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.scores": np.array(scores, np.float32),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_metadata_errors_are_clear():
    with pytest.raises(VocabError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({})
    with pytest.raises(VocabError, match="unsupported tokenizer model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5"})
    meta = byte_level_meta()
    meta["tokenizer.ggml.tokens"] = "not a list"
    with pytest.raises(VocabError, match="array of strings"):
        Tokenizer.from_gguf_metadata(meta)
    meta = spm_meta()
    meta["tokenizer.ggml.scores"] = np.zeros(3, np.float32)
    with pytest.raises(VocabError, match="entries for"):
        Tokenizer.from_gguf_metadata(meta)
    meta = byte_level_meta()
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(VocabError, match="merges"):
        Tokenizer.from_gguf_metadata(meta)


def test_out_of_range_special_id_keeps_the_default(caplog):
    meta = spm_meta()
    meta["tokenizer.ggml.bos_token_id"] = 10**6
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.bos_id == 1 and "outside the vocabulary" in caplog.text


def test_unknown_pre_tokenizer_falls_back_with_a_warning(caplog):
    meta = byte_level_meta(merges=["Ġ h"], pre="no-such-pre")
    tok = Tokenizer.from_gguf_metadata(meta)
    with caplog.at_level(logging.WARNING):
        ids = tok.encode("hi there", add_special=False)
    assert "unknown pre-tokenizer" in caplog.text
    assert tok.decode(ids) == "hi there"


def test_byte_level_merges_and_bad_merges(caplog):
    extra = [("he", NORMAL), ("hel", NORMAL), ("<|end|>", CONTROL)]
    # "x y" has no "xy" token: llama.cpp would merge and spell it in bytes; we drop it loudly.
    tok = Tokenizer.from_gguf_metadata(byte_level_meta(extra, merges=["h e", "he l", "x y"]))
    with caplog.at_level(logging.WARNING):
        ids = tok.encode("help<|end|>", add_special=False)
    assert "ignored 1 BPE merges" in caplog.text
    assert ids == [257, ord("p"), 258]  # "hel" "p" "<|end|>"; plain byte tokens have id == byte
    # <|end|> by name, and 11: llama.cpp's default EOS id for BPE vocabularies without one.
    assert tok.eog_ids == {11, 258}


def test_spm_space_prefix_and_leading_space_rule():
    tok = Tokenizer.from_gguf_metadata(spm_meta())
    ids = tok.encode("hello world")
    assert [tok.token_text(i) for i in ids] == ["<s>", "▁hello", "▁world"]
    assert tok.decode(ids[1:]) == "hello world"  # the added space is taken off again
    # llama.cpp keeps the space when it first drops a BOS (skip_special) ...
    assert tok.decode(ids, skip_special=True) == " hello world"
    # ... and when the BOS is shown, the (empty-for-BOS) first piece is the one stripped.
    assert tok.decode(ids) == "<s> hello world"
    no_prefix = Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix=False))
    assert [no_prefix.token_text(i) for i in no_prefix.encode("hello", add_special=False)] == [
        "hello"
    ]


def test_spm_space_prefix_after_every_special_token():
    tok = Tokenizer.from_gguf_metadata(spm_meta())
    ids = tok.encode("hello</s>hello", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["▁hello", "</s>", "▁hello"]


def test_spm_byte_fallback_and_scores_order():
    tok = Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix=False))
    ids = tok.encode("hé", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hé"


def test_derive_merges_orders_by_score_and_finds_every_split():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca"]
    scores = np.array([0, 0, 0, -2, -1, -3, -4], np.float32)
    merges = derive_merges(tokens, scores)
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c"), ("c", "a")]


def test_special_splitter_is_longest_first_not_leftmost():
    splitter = SpecialSplitter([SpecialToken("ab", 1), SpecialToken("bcd", 2)])
    assert splitter.split("abcd") == ["a", 2]  # llama.cpp: longer special first
    assert splitter.split("ab ab") == [1, " ", 1]
    assert splitter.split("xyz") == ["xyz"]
    assert splitter.split("") == []


def test_special_splitter_strips_whitespace_for_lstrip_rstrip():
    splitter = SpecialSplitter(
        [SpecialToken("<r>", 1, rstrip=True), SpecialToken("<l>", 2, lstrip=True)]
    )
    assert splitter.split("a<r>  \n b") == ["a", 1, "b"]
    assert splitter.split("a \t<l>b") == ["a", 2, "b"]


def test_user_defined_tokens_are_split_even_without_parse_special():
    extra = [("<ud>", USER_DEFINED), ("<ctl>", CONTROL)]
    tok = Tokenizer.from_gguf_metadata(byte_level_meta(extra))
    plain = tok.encode("a<ud>b<ctl>", add_special=False, parse_special=False)
    assert plain == [ord("a"), 256, ord("b"), *b"<ctl>"]
    assert tok.encode("a<ud>b<ctl>", add_special=False) == [ord("a"), 256, ord("b"), 257]


def test_add_bos_and_eos_follow_metadata():
    extra = [("<bos>", CONTROL), ("<eos>", CONTROL)]
    meta = byte_level_meta(
        extra, bos_token_id=256, eos_token_id=257, add_bos_token=True, add_eos_token=True
    )
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("") == [256, 257]
    assert tok.encode("", add_special=False) == []
    assert tok.decode(tok.encode("x"), skip_special=True) == "x"


def test_name_rules_make_end_tokens_control_and_eog():
    extra = [("<|im_end|>", NORMAL), ("<|im_start|>", CONTROL)]
    tok = Tokenizer.from_gguf_metadata(byte_level_meta(extra))
    assert 256 in tok.eog_ids
    assert tok.is_special(256)  # forced to control, so it is parsed as a special token
    assert tok.encode("<|im_end|>", add_special=False) == [256]


def test_encode_rejects_bytes():
    tok = Tokenizer.from_gguf_metadata(byte_level_meta())
    with pytest.raises(TypeError):
        tok.encode(b"abc")
