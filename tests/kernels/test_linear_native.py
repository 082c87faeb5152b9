"""Dense Q4_K / Q6_K / Q8_0 linears on the native CPU kernels (`kernels/quant/linear_native.py`):
the few-row GEMM against the one-row kernel (same bits), the C dequantization against gguf-py (same
values), decode-sized calls within the int8 error and prompt-sized calls exact, the policy that
picks them, and a real model loading its Q8_0 head without an fp16 copy."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from localllm.engine.generator import Generator
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear import prepare_linear, quant_matmul_reference
from localllm.kernels.quant.linear_native import NATIVE_MAX_T
from tests.perf.make_synthetic import random_rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0])
@pytest.mark.parametrize("t", [1, 5, 16])
def test_gemm_rows_equal_the_one_row_kernel_bit_for_bit(kernels, qtype, t):
    rng = np.random.default_rng(t)
    n, k = 123, 512
    w = torch.from_numpy(random_rows(qtype, n, k, rng))
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    got = kernels.gemm_rows(w, QuantType(qtype), n, k, x)
    want = torch.stack([kernels.gemv(w, QuantType(qtype), n, k, x[i]) for i in range(t)])
    assert got.shape == (t, n) and torch.equal(got, want)
    assert torch.equal(kernels.gemm_rows(w, QuantType(qtype), n, k, x, threads=1), got)


@pytest.mark.parametrize(("qtype", "k"), [(QT.Q4_K, 1024), (QT.Q6_K, 768), (QT.Q8_0, 576)])
def test_c_dequantization_equals_gguf_py(kernels, qtype, k):
    raw = random_rows(qtype, 40, k, np.random.default_rng(k))
    want = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32)).reshape(40, k)
    got = kernels.dequantize(torch.from_numpy(raw), QuantType(qtype), k)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("qtype", "k"), [(QT.Q4_K, 512), (QT.Q6_K, 512), (QT.Q8_0, 576)])
def test_native_linear_decode_rows_int8_prompt_rows_int16_or_exact(kernels, qtype, k):
    n = 300
    raw = torch.from_numpy(random_rows(qtype, n, k, np.random.default_rng(n)))
    lin = prepare_linear(raw, QuantType(qtype), (n, k), native=kernels)
    assert lin.kind == "native" and lin.nbytes == raw.numel()  # the blocks alone
    gen = torch.Generator().manual_seed(k)
    for t in (1, NATIVE_MAX_T):  # int8 activations (per 256 values for Q4_K, else per 32)
        x = torch.randn(t, k, generator=gen)
        want = quant_matmul_reference(x, raw, QuantType(qtype), (n, k))
        assert _rel(lin.matmul(x), want) < 1.5e-2
    for t in (NATIVE_MAX_T + 1, 2 * NATIVE_MAX_T):  # a prompt: int16 activations by default,
        x = torch.randn(2, t // 2 + 1, k, generator=gen)  # [..., K] inputs keep their lead dims
        want = quant_matmul_reference(x.reshape(-1, k), raw, QuantType(qtype), (n, k))
        got = lin.matmul(x)
        assert got.shape == (*x.shape[:-1], n)
        assert _rel(got.reshape(-1, n), want) < 2e-4
        lin.prompt_i16 = False  # ggml float32 values, an exact fp32 GEMM
        torch.testing.assert_close(lin.matmul(x).reshape(-1, n), want, rtol=1e-5, atol=1e-6)
        lin.prompt_i16 = True


def test_policy_takes_native_only_for_its_types_and_never_when_precise(kernels):
    rng = np.random.default_rng(0)
    q8 = torch.from_numpy(random_rows(QT.Q8_0, 64, 256, rng))
    q4k = torch.from_numpy(random_rows(QT.Q4_K, 64, 256, rng))
    assert prepare_linear(q8, QuantType.Q8_0, (64, 256), native=kernels).kind == "native"
    assert prepare_linear(q8, QuantType.Q8_0, (64, 256)).kind == "dense_f16"  # no kernels
    precise = prepare_linear(q8, QuantType.Q8_0, (64, 256), precise=True, native=kernels)
    assert precise.kind == "dequant_tiles"
    assert prepare_linear(q4k, QuantType.Q4_K, (64, 256), native=kernels).kind == "native"
    assert prepare_linear(q4k, QuantType.Q4_K, (64, 256)).kind == "int4pack1"  # no kernels
    exact = prepare_linear(q4k, QuantType.Q4_K, (64, 256), precise=True, native=kernels)
    assert exact.kind == "int4pack1" and exact.exact_from_t == 0
    q5k = torch.from_numpy(random_rows(QT.Q5_K, 64, 256, rng))
    assert prepare_linear(q5k, QuantType.Q5_K, (64, 256), native=kernels).kind == "native"
    assert prepare_linear(q5k, QuantType.Q5_K, (64, 256)).kind == "dense_f16"  # no kernels
    q3k = torch.zeros(64, 110, dtype=torch.uint8)  # a type the kernels lack: the torch policy
    assert prepare_linear(q3k, QuantType.Q3_K, (64, 256), native=kernels).kind == "dequant_tiles"
    # a strategy a benchmark names is taken as given
    named = prepare_linear(q4k, QuantType.Q4_K, (64, 256), strategy="int4pack", native=kernels)
    assert named.kind == "int4pack1"


def test_a_real_models_q8_0_head_keeps_its_blocks(kernels, smollm2_path):
    gen = Generator.load(str(smollm2_path))
    try:
        head = gen.model.output.kernels()[0]
        w = gen.model.output.weight
        assert w.qtype == QuantType.Q8_0
        assert head.kind == "native" and head.nbytes == w.data.numel()  # no 2-byte copy
    finally:
        gen.close()
