"""IncrementalDetokenizer: streamed text equals decode() of the whole sequence, and no chunk is
ever broken UTF-8."""

from __future__ import annotations

import random

import numpy as np
import pytest

from localllm.engine.gguf import open_gguf
from localllm.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from localllm.engine.tokenizer.detokenizer import _incomplete_tail
from localllm.engine.tokenizer.pieces import gpt2_byte_decoder


def _bytes_tokenizer(**keys) -> Tokenizer:
    """256 byte-level tokens (id == byte value) plus <s> </s>: any byte string is a token string."""
    decoder = gpt2_byte_decoder()
    chars = sorted(decoder, key=decoder.__getitem__)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [*chars, "<s>", "</s>"],
        "tokenizer.ggml.token_type": np.array([1] * 256 + [3, 3], np.int32),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return Tokenizer.from_gguf_metadata(meta)


def _stream(tok: Tokenizer, ids: list[int], **kw) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, **kw)
    parts = [detok.add(i) for i in ids]
    parts.append(detok.flush())
    return "".join(parts), parts


def _no_lone_surrogates_or_partial(parts: list[str]) -> None:
    for p in parts:
        p.encode("utf-8")  # a str chunk is always whole characters; this would fail otherwise


def test_emoji_split_over_byte_tokens_comes_out_whole():
    tok = _bytes_tokenizer()
    emoji = "😶‍🌫️".encode()
    _, parts = _stream(tok, list(emoji))
    assert "".join(parts) == "😶‍🌫️"
    assert parts[:3] == ["", "", ""] and parts[3] == "😶"  # held until its 4th byte


@pytest.mark.parametrize("seed", range(20))
def test_random_bytes_stream_equals_decode(seed):
    """Random byte soup (valid, truncated and invalid UTF-8 mixed) must decode exactly as
    bytes.decode(errors="replace") does on the whole."""
    rng = random.Random(seed)
    tok = _bytes_tokenizer()
    pool = [
        *"aé€😀".encode(),
        0x80,
        0xBF,
        0xC0,
        0xC2,
        0xE0,
        0xED,
        0xF0,
        0xF4,
        0xF5,
        0xFF,
        0xA0,
        0x90,
    ]
    ids = [rng.choice(pool) for _ in range(rng.randint(0, 60))]
    text, parts = _stream(tok, ids)
    assert text == bytes(ids).decode("utf-8", "replace") == tok.decode(ids)
    _no_lone_surrogates_or_partial(parts)


def test_incomplete_tail_rules():
    assert _incomplete_tail(b"") == 0
    assert _incomplete_tail(b"a\xf0\x9f\x98") == 3
    assert _incomplete_tail(b"\xf0\x9f\x98\x80") == 0
    assert _incomplete_tail(b"\xe0\x80") == 0  # overlong: can never complete
    assert _incomplete_tail(b"\xed\xa0") == 0  # surrogate range
    assert _incomplete_tail(b"\xc2") == 1
    assert _incomplete_tail(b"\xf5") == 0


@pytest.mark.parametrize("skip", [False, True])
def test_skip_special_and_eos_handling(skip):
    tok = _bytes_tokenizer(add_bos_token=True, add_eos_token=True)
    for ids in ([256, 104, 105, 257], [257, 104, 257], [256], [257], [256, 257, 256, 104]):
        text, _ = _stream(tok, ids, skip_special=skip)
        assert text == tok.decode(ids, skip_special=skip), ids


def test_prompt_ids_carry_a_split_character():
    tok = _bytes_tokenizer()
    data = list("ok 😀!".encode())
    cut = data.index(0xF0) + 2  # the prompt ends in the middle of the emoji
    detok = IncrementalDetokenizer(tok, prompt_ids=data[:cut])
    out = detok.add_many(data[cut:]) + detok.flush()
    assert out == "😀!"


@pytest.fixture(scope="module")
def real_tokenizers(request):
    out = []
    for name in ("smollm2_path", "gemma3_path"):
        try:
            path = request.getfixturevalue(name)
        except pytest.skip.Exception:
            continue
        out.append(Tokenizer.from_gguf_metadata(open_gguf(path).metadata))
    if not out:
        pytest.skip("no model package installed")
    return out


@pytest.mark.parametrize("skip", [False, True])
def test_real_vocab_random_ids(real_tokenizers, skip):
    """Random ids from the whole vocabulary (byte-fallback, special, multi-byte tokens)."""
    for tok in real_tokenizers:
        rng = random.Random(1234)
        for _ in range(30):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.5:  # Gemma's <0xNN> tokens: the usual source of split characters
                ids += [rng.randrange(238, 494) for _ in range(rng.randint(1, 8))]
                rng.shuffle(ids)
            text, parts = _stream(tok, ids, skip_special=skip)
            assert text == tok.decode(ids, skip_special=skip)
            _no_lone_surrogates_or_partial(parts)


def test_real_vocab_encoded_text_streams_back(real_tokenizers):
    text = "Emoji 👨‍👩‍👧‍👦 and 中文 and e\u0301 — done.\n"
    for tok in real_tokenizers:
        ids = tok.encode(text, add_special=False)
        assert _stream(tok, ids)[0] == text
