"""prepare_linear's strategies against quant_matmul_reference (dequantize + fp32 matmul).

Tolerances (relative Frobenius error of y against the fp32 reference):
- exact paths (int4pack fp32 tiles, dequant tiles, dense fp32, precise=True): 1e-5
  (only fp32 summation order differs);
- bf16 paths (int4pack bf16 kernel; dense bf16 at any T, its weights are bf16): 1e-2; bf16
  keeps 8 significant bits of x and of the weights or scales, measured 1.5e-3 to 3e-3 on
  gaussian data (tests/perf/results/cpu.md);
- fp16 paths (dense fp16 at any T): 2e-3; 11 significant bits, measured 2e-4 to 4e-4.
"""

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import quants

from localllm.kernels.quant import DEQUANT_TYPES, QuantType, dequantize, int4pack
from localllm.kernels.quant.affine import CODE_BITS
from localllm.kernels.quant.linear import (
    choose_strategy,
    prepare_linear,
    quant_matmul_reference,
)

EXACT_TOL, F16_TOL, BF16_TOL = 1e-5, 2e-3, 1e-2
GGUF_QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4", "BF16"}
FAST_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K", "BF16", "F32"]


def weight(name: str, n: int, k: int, make_blocks) -> torch.Tensor:
    """Realistic raw blocks: gguf's quantizer on gaussian weights where it has one, else random
    blocks with finite scales."""
    rng = np.random.default_rng(zlib.crc32(f"{name}/{n}/{k}".encode()))
    if name in GGUF_QUANTIZABLE:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = np.frombuffer(quants.quantize(w, G[name]).tobytes(), np.uint8).reshape(n, -1)
    elif name in ("F32", "F16"):
        w = rng.standard_normal((n, k)) * 0.05
        raw = w.astype(np.float32 if name == "F32" else np.float16).view(np.uint8)
    else:
        from gguf import GGML_QUANT_SIZES

        block = GGML_QUANT_SIZES[G[name]][0]
        raw = make_blocks(name, n, k // block, rng)
    return torch.from_numpy(np.array(raw))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    return ((y - ref).norm() / ref.norm()).item()


def expected_tol(prep, t: int, precise: bool) -> float:
    if precise:
        return EXACT_TOL
    if prep.kind == "dense_bf16":  # the weights themselves are rounded to bf16
        return BF16_TOL
    if prep.kind == "dense_f16":
        return F16_TOL
    if prep.kind.startswith("int4pack") and t < prep.exact_from_t:
        return BF16_TOL
    return EXACT_TOL


@pytest.mark.parametrize("precise", [False, True], ids=["default", "precise"])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("name", FAST_TYPES)
def test_default_policy_matches_reference(name, t, precise, make_blocks):
    n, k = 80, 512  # 80 rows: a 64-row block plus a 16-row tail of the packed int4 layout
    qtype = QuantType[name]
    data = weight(name, n, k, make_blocks)
    prep = prepare_linear(data, qtype, (n, k), precise=precise)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    err = rel_err(prep.matmul(x), quant_matmul_reference(x, data, qtype, (n, k)))
    assert err <= expected_tol(prep, t, precise), (prep.kind, err)


@pytest.mark.parametrize(
    "strategy", ["int4pack", "dense_f16", "dense_bf16", "dequant_tiles", "dense_f32"]
)
@pytest.mark.parametrize("name", sorted(t.name for t in CODE_BITS))
def test_every_strategy_on_integer_code_types(name, strategy, make_blocks):
    n, k = 48, 256
    qtype = QuantType[name]
    data = weight(name, n, k, make_blocks)
    prep = prepare_linear(data, qtype, (n, k), strategy=strategy)
    for t in (1, 7, 64):
        # seeded: a fresh x each run made the bf16 path's error a random draw that crossed the
        # 1e-2 bound about once a day (0.0126 seen, typical ~3e-3)
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        err = rel_err(prep.matmul(x), quant_matmul_reference(x, data, qtype, (n, k)))
        assert err <= expected_tol(prep, t, precise=False), (prep.kind, t, err)


@pytest.mark.parametrize("name", sorted(t.name for t in DEQUANT_TYPES))
def test_every_dequantizable_type_loads_and_runs(name, make_blocks):
    n, k = 32, 512
    qtype = QuantType[name]
    data = weight(name, n, k, make_blocks)
    prep = prepare_linear(data, qtype, (n, k))
    for t in (1, 7):
        x = torch.randn(t, k)
        err = rel_err(prep.matmul(x), quant_matmul_reference(x, data, qtype, (n, k)))
        assert err <= expected_tol(prep, t, precise=False), (prep.kind, err)


@pytest.mark.parametrize("name", sorted(t.name for t in CODE_BITS))
def test_int4pack_weight_equals_gguf_dequant(name, make_blocks):
    n, k = 176, 256  # full 32/64-row blocks and a 16/48-row tail in either packed layout
    if not int4pack.unpack_supported():
        pytest.skip("this torch build's int4pack layout is not one unpack_t knows")
    qtype = QuantType[name]
    data = weight(name, n, k, make_blocks)
    prep = prepare_linear(data, qtype, (n, k), strategy="int4pack")
    ref = dequantize(data, qtype).reshape(n, k)
    assert torch.equal(prep.weight_t(0, n), ref.T)  # values equal (+0 and -0 compare equal)
    assert torch.equal(prep.weight_t(64, 176), ref[64:].T)  # a row tile from a 64 boundary


def test_int4pack_unpack_inverts_pack():
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert int4pack.unpack_supported()  # the layouts of x86 builds are known
    if not int4pack.unpack_supported():
        pytest.skip("unknown int4pack layout on this CPU build")
    gen = torch.Generator().manual_seed(5)
    for n in (16, 48, 96, 176, 1040):
        codes = torch.randint(0, 16, (n, 64), generator=gen, dtype=torch.uint8)
        packed = int4pack.pack(codes)
        assert torch.equal(int4pack.unpack_t(packed), codes.T)
        if n > 64:
            assert torch.equal(int4pack.unpack_t(packed[64:]), codes[64:].T)


def test_tiles_and_leading_dims(make_blocks):
    # 2112 rows x 512 spans two row tiles of the fp32 paths
    n, k = 2112, 512
    data = weight("Q4_K", n, k, make_blocks)
    x = torch.randn(2, 3, k)
    ref = quant_matmul_reference(x.reshape(-1, k), data, QuantType.Q4_K, (n, k)).reshape(2, 3, n)
    for strategy in ("int4pack", "dense_f16", "dequant_tiles"):
        prep = prepare_linear(data, QuantType.Q4_K, (n, k), strategy=strategy, precise=True)
        y = prep.matmul(x)
        assert y.shape == (2, 3, n)
        assert rel_err(y, ref) <= EXACT_TOL, strategy


def test_rows_not_a_multiple_of_16_fall_back(make_blocks):
    n, k = 24, 256
    data = weight("Q4_0", n, k, make_blocks)
    assert choose_strategy(QuantType.Q4_0, (n, k), torch.device("cpu")) == "dense_f16"
    prep = prepare_linear(data, QuantType.Q4_0, (n, k))
    x = torch.randn(3, k)
    assert rel_err(prep.matmul(x), quant_matmul_reference(x, data, QuantType.Q4_0, (n, k))) < 1e-2


def test_memory_held_per_weight(make_blocks):
    n, k = 256, 512
    bytes_per_weight = {}
    for name, strategy in [("Q4_K", "int4pack"), ("Q5_0", "int4pack"), ("Q8_0", "dense_f16")]:
        data = weight(name, n, k, make_blocks)
        prep = prepare_linear(data, QuantType[name], (n, k), strategy=strategy)
        bytes_per_weight[prep.kind] = prep.nbytes / (n * k)
    # packed codes 0.5 B/plane + bf16 scale/zero 0.125 B/plane + fp32 a, b 0.25 B
    assert bytes_per_weight == {"int4pack1": 0.875, "int4pack2": 1.5, "dense_f16": 2.0}


def test_bad_arguments(make_blocks):
    data = weight("Q4_0", 32, 256, make_blocks)
    with pytest.raises(ValueError, match="does not hold"):
        prepare_linear(data, QuantType.Q4_0, (32, 512))
    with pytest.raises(ValueError, match="unknown strategy"):
        prepare_linear(data, QuantType.Q4_0, (32, 256), strategy="magic")
    with pytest.raises(ValueError, match="no int4pack form"):
        prepare_linear(
            weight("Q6_K", 32, 256, make_blocks), QuantType.Q6_K, (32, 256), strategy="int4pack"
        )


@pytest.mark.slow
def test_real_smollm2_weights(smollm2_path):
    from localllm.engine.gguf import open_gguf

    model = open_gguf(smollm2_path)
    for name in ("blk.0.ffn_down.weight", "blk.5.attn_k.weight", "token_embd.weight"):
        w = model.weight(name)
        data, shape = w.data[:1024], (min(1024, w.shape[0]), w.shape[1])
        prep = prepare_linear(data, w.qtype, shape)
        for t in (1, 64):
            x = torch.randn(t, shape[1])
            err = rel_err(prep.matmul(x), quant_matmul_reference(x, data, w.qtype, shape))
            assert err <= expected_tol(prep, t, precise=False), (name, prep.kind, t, err)


def test_policy_per_device_and_type():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert choose_strategy(QuantType.Q4_K, (640, 1024), cpu) == "int4pack"
    assert choose_strategy(QuantType.Q6_K, (640, 2048), cpu) == "dense_f16"
    assert choose_strategy(QuantType.IQ2_XS, (640, 2048), cpu) == "dequant_tiles"
    assert choose_strategy(QuantType.Q4_K, (640, 1024), gpu) == "triton"
    assert choose_strategy(QuantType.IQ2_XS, (640, 2048), gpu) == "dequant_tiles"
    assert choose_strategy(QuantType.F32, (640, 2048), gpu) == "dense_f32"


def test_fp16_range_guards():
    n, k = 32, 256
    gen = torch.Generator().manual_seed(3)
    big = (torch.randn(n, k, generator=gen) * 1e5).contiguous()  # beyond fp16's 65504
    data = big.view(torch.uint8).reshape(n, -1)
    prep = prepare_linear(data, QuantType.F32, (n, k), strategy="dense_f16")
    assert prep.kind == "dense_bf16"  # the weights do not fit fp16, so bf16 was kept
    # activations that would overflow fp16 inside the GEMV take the fp32 path instead
    w = weight("Q8_0", n, k, None)
    prep = prepare_linear(w, QuantType.Q8_0, (n, k), strategy="dense_f16")
    assert prep.kind == "dense_f16"
    x = torch.randn(1, k, generator=gen) * 1e5
    y, ref = prep.matmul(x), quant_matmul_reference(x, w, QuantType.Q8_0, (n, k))
    assert rel_err(y, ref) <= F16_TOL  # finite and close (rel_err checks finiteness)
