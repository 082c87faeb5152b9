"""`make_synthetic.py --shape smollm3-3b`: a random-weight SmolLM3 file, cut to a few small layers.

The maker writes the `smollm3.*` keys llama.cpp's converter writes (the converted family fixture
is the reference) and ties the head to a Q6_K token_embd as llama.cpp's Q4_K_M does; our engine
loads it as the smollm3 family (NoPE on every fourth layer) with the head read from the embedding
(checked against gguf-py's dequantization), and generates.
"""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from localllm.engine import LLM, SamplingParams
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.models import smollm3
from tests.engine.family_goldens import path as family_path
from tests.perf.make_synthetic import SHAPES, tensor_plan, write_synthetic

# the 3B shape with small dims (K-quant rows need multiples of 256) and 4 layers: the last NoPE
SMALL = dataclasses.replace(
    SHAPES["smollm3-3b"], n_layers=4, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, hidden=512,
    vocab=1024, context=2048,
)  # fmt: skip


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = tmp_path_factory.mktemp("smollm3") / "small.gguf"
    write_synthetic(p, SMALL, "Q4_K_M", None, seed=2)  # byte-level tokenizer
    return p


def _arch_keys(path) -> dict:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("smollm3.")}


def test_keys_are_the_converters(small):
    """The same smollm3.* keys (names and value kinds) as llama.cpp's converter wrote."""
    ours, converted = _arch_keys(small), _arch_keys(family_path("smollm3"))
    assert sorted(ours) == sorted(converted)
    assert ours["smollm3.rope.freq_base"] == 5e6
    assert ours["smollm3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert ours["smollm3.block_count"] == 4 and ours["smollm3.embedding_length"] == 256


def test_tied_head_is_a_q6k_embedding(small):
    types = {t.name: t.tensor_type for t in GGUFReader(small).tensors}
    assert "output.weight" not in types
    assert types["token_embd.weight"] == QT.Q6_K
    assert types["blk.0.ffn_gate.weight"] == QT.Q4_K
    # the whole shape: 36 layers and the same tie
    plan = {name: qt for name, _dims, qt in tensor_plan(SHAPES["smollm3-3b"], "Q4_K_M")}
    assert "output.weight" not in plan and plan["token_embd.weight"] == QT.Q6_K
    assert "blk.35.ffn_down.weight" in plan and "blk.36.attn_norm.weight" not in plan


def test_engine_loads_it_as_smollm3(small):
    g = open_gguf(str(small))
    try:
        model = build_model(g, precise=True)
    finally:
        g.close()
    assert isinstance(model, smollm3.Model)
    assert [b.rope for b in model.blk] == [True, True, True, False]
    t = next(t for t in GGUFReader(small).tensors if t.name == "token_embd.weight")
    want = dequantize(t.data, t.tensor_type).reshape(SMALL.vocab, SMALL.dim)
    hidden = torch.eye(SMALL.dim)[:8]  # unit vectors: the head's columns 0..7
    with torch.inference_mode():
        got = model.logits(hidden).float().numpy()
    np.testing.assert_allclose(got, want[:, :8].T, rtol=1e-5, atol=1e-6)


def test_engine_generates(small):
    llm = LLM(str(small), max_model_len=128, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert len(a) == 12 and all(0 <= t < SMALL.vocab for t in a)
    assert a == b  # greedy: the same tokens again
