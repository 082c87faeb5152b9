"""Hostile hyperparameters in every model family: a clean error naming the file and the key.

Each family's tiny runnable model (tests/engine/hostile_gguf.py) is written again with one key
set to a value a corrupt or hostile file could carry. The engine must refuse it while loading,
with a ValueError that starts with the file's path and names the key, before it builds layers or
allocates from the value: each load runs under a watchdog and an address-space budget.
"""

import math

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from localllm.engine.config import EngineArgs
from localllm.engine.llm_engine import LLMEngine
from tests.engine.gguf_fixtures import GGUFValue
from tests.engine.hostile_gguf import (
    FAMILIES,
    TOKENS,
    base,
    flipped_token,
    hparam,
    write_variant,
)
from tests.engine.load_limits import load_limits

ENGINE_ARGS = EngineArgs(kv_cache_memory=1 << 20, max_num_seqs=2)


def u32(v: int) -> GGUFValue:
    return GGUFValue(v, VT.UINT32)


def _eps_key(family: str) -> str:
    meta = base(family)[1]
    rms = hparam(family, "attention.layer_norm_rms_epsilon")
    return rms if rms in meta else hparam(family, "attention.layer_norm_epsilon")


# (hyperparameter, value): every family reads these keys
CASES = {
    "block_count 10^6": ("block_count", u32(10**6)),
    "block_count 2^31": ("block_count", u32(2**31)),
    "context_length 2^31": ("context_length", u32(2**31 - 1)),
    "embedding_length 2^31": ("embedding_length", u32(2**31 - 1)),
    "embedding_length 0": ("embedding_length", u32(0)),
    "feed_forward_length 2^31": ("feed_forward_length", u32(2**31 - 1)),
    "head_count 0": ("attention.head_count", u32(0)),
    "head_count 2^31": ("attention.head_count", u32(2**31 - 1)),
    "head_count float": ("attention.head_count", 4.0),
    "head_count string": ("attention.head_count", "4"),
    "rope base 0": ("rope.freq_base", 0.0),
    "rope base NaN": ("rope.freq_base", math.nan),
    "rope base -inf": ("rope.freq_base", -math.inf),
}


def expect_refused(path, *needles: str) -> str:
    with load_limits(), pytest.raises(ValueError) as e:
        LLMEngine(str(path), ENGINE_ARGS)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES)
def test_hostile_hyperparameter(tmp_path, family, case):
    name, value = CASES[case]
    path = write_variant(tmp_path / "h.gguf", family, {hparam(family, name): value})
    expect_refused(path, name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value", [-1e-5, 0.0, math.nan, math.inf])
def test_bad_norm_epsilon(tmp_path, family, value):
    key = _eps_key(family)
    path = write_variant(tmp_path / "h.gguf", family, {key: value})
    expect_refused(path, key)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bert"])
def test_huge_rope_dimension(tmp_path, family):
    path = write_variant(
        tmp_path / "h.gguf", family, {hparam(family, "rope.dimension_count"): u32(2**31 - 1)}
    )
    expect_refused(path, "rope.dimension_count")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("bert", "deepseek2")])
@pytest.mark.parametrize("kv", [0, 3])
def test_kv_heads_must_divide_heads(tmp_path, family, kv):
    path = write_variant(
        tmp_path / "h.gguf", family, {hparam(family, "attention.head_count_kv"): u32(kv)}
    )
    expect_refused(path, "head_count_kv")


@pytest.mark.parametrize("family", FAMILIES)
def test_vocabulary_size_must_match_the_embedding(tmp_path, family):
    tokens = base(family)[1][TOKENS]
    n = len(tokens) - 7
    short = {TOKENS: tokens[:n], "tokenizer.ggml.token_type": np.ones(n, np.int32)}
    path = write_variant(tmp_path / "h.gguf", family, short)
    expect_refused(path, f"{n} tokens", "token_embd.weight")


@pytest.mark.parametrize("family", FAMILIES)
def test_flipped_bit_in_a_token(tmp_path, family):
    path = write_variant(tmp_path / "h.gguf", family, {TOKENS: flipped_token(family, 20)})
    expect_refused(path, "token 20", "UTF-8")


# (gemma2's vocabulary is SentencePiece: its `▁` pieces are WordPiece-shaped, not a BPE's)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("bert", "gemma2")])
def test_wordpiece_on_a_bpe_vocabulary(tmp_path, family):
    path = write_variant(tmp_path / "h.gguf", family, {"tokenizer.ggml.model": "bert"})
    expect_refused(path, "bert")


def test_byte_level_bpe_on_a_wordpiece_vocabulary(tmp_path):
    """The fuzz test's case 1594 (of 2000): a WordPiece vocabulary labelled gpt2 loaded, then
    encoded every text to no tokens at all."""
    path = write_variant(tmp_path / "h.gguf", "bert", {"tokenizer.ggml.model": "gpt2"})
    expect_refused(path, "gpt2", "byte-level")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_base_model_loads_within_the_limits(tmp_path, family):
    """The limits above refuse the hostile files, not the models themselves."""
    path = write_variant(tmp_path / "ok.gguf", family)
    with load_limits():
        engine = LLMEngine(str(path), ENGINE_ARGS)
    assert engine.model.args.n_layers >= 2
