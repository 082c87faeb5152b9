"""Shared test data for the quant kernels: random ggml blocks with realistic (finite) scales."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import quants

from localllm.kernels.quant import QuantType, block_geometry

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


@pytest.fixture
def make_blocks():
    """random_blocks(name, rows, blocks_per_row, rng, finite=True) -> uint8 [rows, row_bytes]."""
    return random_blocks


@pytest.fixture(scope="session")
def kernels(tmp_path_factory):
    """The native CPU kernels (`kernels/cpu/moe_gemv.c`) built into a fresh directory; the test
    skips where no C compiler is (the torch paths are used there)."""
    from localllm.kernels.cpu import native

    k = native.load(tmp_path_factory.mktemp("native"))
    if k is None:
        pytest.skip("no C compiler here (the torch paths are used)")
    return k
