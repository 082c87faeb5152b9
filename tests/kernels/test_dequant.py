"""The torch dequant references against gguf-py's numpy ones, bit for bit, for every ggml type."""

import importlib.util
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import quants

from localllm.kernels.quant import DEQUANT_TYPES, QuantType, block_geometry, dequantize
from localllm.kernels.quant.dequant import UnsupportedQuantError

ALL_TYPES = sorted(t.name for t in DEQUANT_TYPES)


def _seed(name: str, case: int) -> int:
    return zlib.crc32(f"{name}/{case}".encode())


def _ours(raw: np.ndarray, name: str) -> np.ndarray:
    return dequantize(torch.from_numpy(np.array(raw)), QuantType[name]).numpy()


def _ref(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):  # random fp16 scales give inf * 0 in gguf-py too
        return np.asarray(quants.dequantize(np.array(raw), G[name]), dtype=np.float32)


def _gguf_can_decode(qtype: G) -> bool:
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
    try:
        quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def test_every_type_gguf_can_decode_is_covered():
    gguf_types = {t.name for t in G if t in gguf.GGML_QUANT_SIZES and _gguf_can_decode(t)}
    assert set(ALL_TYPES) == gguf_types


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda t: t.name)
def test_block_geometry_matches_gguf(qtype):
    assert block_geometry(qtype) == gguf.GGML_QUANT_SIZES[G(int(qtype))]
    assert G(int(qtype)).name == qtype.name


@pytest.mark.parametrize("name", ALL_TYPES)
def test_bit_exact_finite_scales(name, make_blocks):
    rng = np.random.default_rng(_seed(name, 0))
    raw = make_blocks(name, rows=5, blocks_per_row=3, rng=rng)
    ours, ref = _ours(raw, name), _ref(raw, name)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_bit_exact_raw_random_bytes(name, make_blocks):
    rng = np.random.default_rng(_seed(name, 1))
    raw = make_blocks(name, rows=4, blocks_per_row=4, rng=rng, finite=False)
    with np.errstate(all="ignore"):
        assert np.array_equal(_ours(raw, name), _ref(raw, name), equal_nan=True)


def test_leading_dims_and_empty(make_blocks):
    rng = np.random.default_rng(7)
    raw = make_blocks("Q4_K", rows=6, blocks_per_row=2, rng=rng).reshape(2, 3, -1)
    out = dequantize(torch.from_numpy(raw), QuantType.Q4_K)
    assert out.shape == (2, 3, 512)
    assert np.array_equal(out.numpy(), _ref(raw.reshape(6, -1), "Q4_K").reshape(2, 3, 512))
    empty = dequantize(torch.empty(0, 144, dtype=torch.uint8), QuantType.Q4_K)
    assert empty.shape == (0, 256)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="whole number"):
        dequantize(torch.zeros(2, 19, dtype=torch.uint8), QuantType.Q4_0)
    with pytest.raises(TypeError):
        dequantize(torch.zeros(2, 18, dtype=torch.int8), QuantType.Q4_0)
    with pytest.raises(UnsupportedQuantError):
        dequantize(torch.zeros(1, 40, dtype=torch.uint8), QuantType.Q8_1)


@pytest.mark.parametrize(
    "name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
)
def test_bit_exact_on_gguf_quantized_gaussian(name):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((8, 512)).astype(np.float32)
    raw = quants.quantize(w, G[name])
    assert np.array_equal(_ours(raw, name).view(np.uint32), _ref(raw, name).view(np.uint32))


# ---- real tensors from the SmolLM2 package (Q4_1 blocks + the Q8_0 tied embedding) ----


@pytest.fixture(scope="module")
def smollm2_tensors(smollm2_path):
    reader = gguf.GGUFReader(smollm2_path)  # ~6 s: once per module
    return {t.name: t for t in reader.tensors}


@pytest.mark.slow
@pytest.mark.parametrize(
    "tensor", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"]
)
def test_bit_exact_on_smollm2(smollm2_tensors, tensor):
    t = smollm2_tensors[tensor]
    name = G(t.tensor_type).name
    assert name in ("Q4_1", "Q8_0")
    raw = np.asarray(t.data[:256])  # first rows only: the embedding is 49152 rows
    ours, ref = _ours(raw, name), _ref(raw, name)
    assert ours.shape == (256, t.shape[0])
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_generated_grid_table_is_current():
    gen = Path(__file__).resolve().parents[1] / "tools" / "gen_iq_grids.py"
    spec = importlib.util.spec_from_file_location("gen_iq_grids", gen)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUT.read_text() == module.render(), "run tests/tools/gen_iq_grids.py"
