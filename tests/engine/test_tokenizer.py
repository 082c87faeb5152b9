"""Tokenizers of the real tiny models against goldens recorded from llama.cpp.

The goldens (tests/data/tokenizer/*.json) come from tests/tools/record_tokenizer_goldens.py:
llama.cpp's token ids for ~47 strings x (add_special, parse_special), its detokenized text, token
pieces and end-of-generation ids. Our ids must be identical, not merely close.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localllm.engine.gguf import open_gguf
from localllm.engine.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
MODELS = ("smollm2", "gemma3")


def _golden(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


GOLDENS = {name: _golden(name) for name in MODELS}


@pytest.fixture(scope="module")
def tokenizers(request) -> dict[str, Tokenizer]:
    """Both tokenizers, built once per module; a model whose package is missing is skipped."""
    built = {}
    for name in MODELS:
        try:
            path = request.getfixturevalue(f"{name}_path")
        except pytest.skip.Exception:
            continue
        tok = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
        tok.warm_up()
        built[name] = tok
    return built


def _tok(tokenizers: dict[str, Tokenizer], name: str) -> Tokenizer:
    if name not in tokenizers:
        pytest.skip(f"model package for {name} is not installed")
    return tokenizers[name]


CASES = [(name, i) for name in MODELS for i in range(len(GOLDENS[name]["cases"]))]


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_ids_match_llama_cpp(tokenizers, name, index):
    tok = _tok(tokenizers, name)
    case = GOLDENS[name]["cases"][index]
    for key, expected in case["ids"].items():
        add, special = key.startswith("add1"), key.endswith("special1")
        got = tok.encode(case["text"], add_special=add, parse_special=special)
        assert got == expected, f"{key} for {case['text']!r}"


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_decode_matches_llama_cpp(tokenizers, name, index):
    tok = _tok(tokenizers, name)
    case = GOLDENS[name]["cases"][index]
    ids = case["ids"]["add1_special1"]
    assert tok.decode_bytes(ids).hex() == case["decode_keep"]
    assert tok.decode_bytes(ids, skip_special=True).hex() == case["decode_skip"]


@pytest.mark.parametrize("name", MODELS)
def test_pieces_and_special_ids_match_llama_cpp(tokenizers, name):
    tok = _tok(tokenizers, name)
    golden = GOLDENS[name]
    assert tok.vocab_size == golden["n_vocab"]
    assert (tok.bos_id, tok.eos_id) == (golden["bos"], golden["eos"])
    assert sorted(tok.eog_ids) == golden["eog"]
    wrong = [i for i, h in golden["pieces"].items() if tok.piece(int(i)).hex() != h]
    assert not wrong, f"pieces differ for ids {wrong[:10]}"
    # Tokens llama.cpp renders as nothing with special=False are exactly our hidden ones.
    sample = [int(i) for i in golden["pieces"]]
    hidden = [i for i in sample if tok.is_special(i) and tok.piece(i)]
    assert hidden == golden["hidden_in_sample"]


@pytest.mark.parametrize("name", MODELS)
def test_roundtrip(tokenizers, name):
    tok = _tok(tokenizers, name)
    for case in GOLDENS[name]["cases"]:
        text = case["text"]
        for parse_special in (False, True):
            ids = tok.encode(text, add_special=False, parse_special=parse_special)
            assert tok.decode(ids) == text, (text, parse_special)


def test_special_tokens_in_chat_markup(tokenizers):
    smol = _tok(tokenizers, "smollm2")
    ids = smol.encode("<|im_start|>user\nHi<|im_end|>", add_special=False)
    assert ids[0] == 1 and ids[-1] == 2
    plain = smol.encode("<|im_start|>user\nHi<|im_end|>", add_special=False, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(ids, skip_special=True) == "user\nHi"


def test_gemma_special_layout(tokenizers):
    gemma = _tok(tokenizers, "gemma3")
    assert gemma.add_bos and gemma.bos_id == 2
    assert gemma.encode("")[:1] == [2]
    turn = gemma.encode("<start_of_turn>user\n", add_special=False)
    assert turn[0] == 105  # <start_of_turn>
    assert {1, 106} <= gemma.eog_ids  # <eos>, <end_of_turn>
    # byte fallback: a character outside the vocabulary is spelled as <0xNN> tokens
    rare = "\U000e0041"  # TAG LATIN CAPITAL LETTER A
    ids = gemma.encode(rare, add_special=False)
    assert all(gemma.token_text(i).startswith("<0x") for i in ids) and len(ids) == 4
    assert gemma.decode(ids) == rare


def test_ids_out_of_range_are_rejected(tokenizers):
    tok = next(iter(tokenizers.values()), None)
    if tok is None:
        pytest.skip("no model package installed")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(ValueError):
        tok.piece(10**9)
