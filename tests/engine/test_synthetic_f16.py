"""`make_synthetic.py --quant F16 --shape smollm2-135m`: a random-weight F16 file (the GPU script's
F16 text row, tests/perf/gpu_vision_siglip.sh), cut to 2 layers: every matrix F16 (the tied head
too), values of std ~1/sqrt(K) as gguf-py reads them, and our engine loads and generates."""

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from localllm.engine import LLM, SamplingParams
from tests.perf.make_synthetic import SHAPES, write_synthetic

SMALL = dataclasses.replace(SHAPES["smollm2-135m"], n_layers=2, vocab=1024)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = tmp_path_factory.mktemp("f16") / "small.gguf"
    write_synthetic(p, SMALL, "F16", None, seed=3)  # byte-level tokenizer
    return p


def test_every_matrix_is_f16_of_the_planned_scale(small):
    r = GGUFReader(small)
    mats = {t.name: t for t in r.tensors if len(t.shape) == 2}
    assert "output.weight" not in mats  # tied, as SmolLM2
    assert {t.tensor_type for t in mats.values()} == {QT.F16}
    down = mats["blk.1.ffn_down.weight"]
    assert tuple(int(d) for d in down.shape) == (SMALL.hidden, SMALL.dim)  # gguf order: K first
    w = np.asarray(down.data, dtype=np.float32)
    assert w.std() * np.sqrt(SMALL.hidden) == pytest.approx(1.0, rel=0.02)


def test_engine_loads_and_generates(small):
    llm = LLM(str(small), max_model_len=128, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert len(a) == 8 and all(0 <= t < SMALL.vocab for t in a)
    assert a == b  # greedy: the same tokens again
