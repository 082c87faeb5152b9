"""Triton keep-quant kernels against the torch dequant reference, on fresh random blocks.

Runs on a CUDA device (marked `gpu`), or on CPU tensors under TRITON_INTERPRET=1 (small shapes,
logic only; the interpreter is too slow for CI, so these never run there).
Tolerances: GEMV (float32 accumulation) 1e-5 relative to an fp64 reference; bf16 dequant within
bf16 rounding of each value (2^-8 relative: round-to-nearest on GPU, the interpreter truncates);
the bf16 prefill GEMM 1e-2 relative.
"""

import os
import secrets

import numpy as np
import pytest
import torch

from localllm.kernels.quant import QuantType, dequantize, prepare_linear
from localllm.kernels.quant.linear import TRITON_TYPES

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or INTERPRET),
        reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton installed)",
    ),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = ["Q8_0", "Q4_0", "IQ4_NL", "MXFP4", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K"]
# (rows, K): rows not a multiple of any BLOCK_N, K over several blocks; GPU adds real sizes
SHAPES = [(37, 768)] if INTERPRET else [(37, 768), (4096 + 8, 4096), (1000, 14336)]


def _case(random_blocks, name: str, n: int, k: int):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    block = 32 if name in ("Q8_0", "Q4_0", "IQ4_NL", "MXFP4") else 256
    blocks = random_blocks(name, n, k // block, rng)
    if name == "MXFP4":  # exponent bytes near 2^0: random ones overflow float32 to inf
        blocks.reshape(-1, 17)[:, 0] = rng.integers(110, 140, blocks.size // 17)
    raw = torch.from_numpy(blocks)
    w = dequantize(raw, QuantType[name]).reshape(n, k).double()
    assert torch.isfinite(w).all() and (w != 0).any()
    return seed, raw.to(DEVICE), w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def test_supported_set_matches_linear_policy():
    from localllm.kernels.quant import triton_linear

    assert triton_linear.SUPPORTED == TRITON_TYPES


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_reference(name, shape, m, make_blocks):
    from localllm.kernels.quant import triton_linear

    n, k = shape
    seed, raw, w = _case(make_blocks, name, n, k)
    x = torch.randn(m, k, dtype=torch.float64)
    y = triton_linear.gemv(x.float().to(DEVICE), raw, QuantType[name], n, k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y, x @ w.T) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("name", TYPES)
def test_bf16_dequant_matches_reference(name, make_blocks):
    from localllm.kernels.quant import triton_linear

    n, k = SHAPES[-1]
    seed, raw, w = _case(make_blocks, name, n, k)
    wb = triton_linear.dequantize_bf16(raw, QuantType[name], n, k).double().cpu()
    assert torch.isfinite(wb).all(), f"seed {seed}"
    ulp = 2.0**-7 if INTERPRET else 2.0**-8  # truncation vs round-to-nearest to 8 bits
    assert ((wb - w).abs() <= w.abs() * ulp).all(), f"seed {seed}"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 9, 33, 64, 65])
@pytest.mark.parametrize("past8", ["bf16 copy", "int8", "batch"])
def test_prepared_linear_both_paths(name, m, past8, make_blocks, monkeypatch):
    """Up to 8 rows the GEMVs; past 8 and up to 64 rows packed types take, by switch, the bf16
    copy of the weight, the int8 tensor-core GEMM (`DENSE_INT8`; int8 activations per 32 like
    the GEMVs, both against their float64 oracle) or `batch_gemm` (`BATCH_GEMM`: bf16, as the
    copy); more rows, and the other types past 8, the bf16 GEMM."""
    from localllm.kernels.quant import triton_linear
    from localllm.kernels.quant.triton_linear import DENSE_MAX_ROWS

    monkeypatch.setattr(triton_linear, "DENSE_INT8", past8 == "int8")
    monkeypatch.setattr(triton_linear, "BATCH_GEMM", past8 == "batch")
    dense_int8 = past8 == "int8"
    n, k = SHAPES[0]
    seed, raw, w = _case(make_blocks, name, n, k)
    prep = prepare_linear(raw, QuantType[name], (n, k), strategy="triton")
    assert prep.kind == "triton" and prep.nbytes == raw.numel()
    x = torch.randn(m, k, dtype=torch.float64)
    y = prep.matmul(x.float().to(DEVICE))
    int8 = prep.repacked and (m <= 8 or (dense_int8 and m <= DENSE_MAX_ROWS))
    if int8:  # dp4a kernels and the int8 GEMM (test_triton_packed.py, test_moe_grouped.py)
        from localllm.kernels.quant.q8x_reference import gemv_q8x_reference

        ref = gemv_q8x_reference(x.float(), raw, QuantType[name], n, k)
        assert _rel(y, ref) < (1e-5 if m <= 8 or name == "Q8_0" else 2e-4), f"seed {seed}"
    tol = 1e-5 if m <= 8 and not prep.repacked else 2e-2  # bf16 or int8 activations
    assert _rel(y, x @ w.T) < tol, f"seed {seed}"
    if past8 == "batch" and prep.repacked and 8 < m <= 64:  # the batch GEMM ran: the bf16
        # copy's sums unrounded (1e-4: that path's bf16 GEMM rounds its output, ~2e-3; the
        # GEMVs' int8 rows ~5e-3; test_batch_gemm.py holds the batch GEMM to its tolerances)
        from localllm.kernels.quant.triton_packed import dequantize_packed_t

        copy = x.float().bfloat16().double() @ dequantize_packed_t(prep.packed).double().cpu()
        assert not prep.takes_quantized(m) and _rel(y, copy) < 1e-4, f"seed {seed}"


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_half_shadow_is_the_per_call_copy(name, make_blocks, monkeypatch):
    """`HALF_SHADOW` keeps the bf16 copy made at load: many rows give the very bits of the copy
    made per call, and the linear counts the copy's bytes."""
    from localllm.kernels.quant import triton_linear

    n, k = SHAPES[0]
    _, raw, _ = _case(make_blocks, name, n, k)
    x = torch.randn(70, k).to(DEVICE)
    plain = prepare_linear(raw, QuantType[name], (n, k), strategy="triton")
    monkeypatch.setattr(triton_linear, "HALF_SHADOW", True)
    kept = prepare_linear(raw, QuantType[name], (n, k), strategy="triton")
    assert kept.shadow is not None and plain.shadow is None
    assert kept.nbytes == raw.numel() + 2 * n * k
    assert torch.equal(kept.matmul(x), plain.matmul(x))
    kept.shadow.zero_()  # the GEMM reads the kept copy, not a new one
    assert not kept.matmul(x).any()


@pytest.mark.parametrize("low", [2, 5, 9])
def test_batch_gemm_takes_rows_from_its_minimum(low, make_blocks, monkeypatch):
    """`BATCH_MIN_ROWS` lowers where the batch GEMM starts, never into the GEMVs' 1-4 rows (their
    int8 inputs and LoRA epilogues); rows it takes read float inputs."""
    from localllm.kernels.quant import triton_linear
    from localllm.kernels.quant.triton_packed import dequantize_packed_t

    monkeypatch.setattr(triton_linear, "BATCH_GEMM", True)
    monkeypatch.setattr(triton_linear, "BATCH_MIN_ROWS", low)
    n, k = SHAPES[0]
    _, raw, _ = _case(make_blocks, "Q4_K", n, k)
    prep = prepare_linear(raw, QuantType.Q4_K, (n, k), strategy="triton")
    wt = dequantize_packed_t(prep.packed).double().cpu()
    for m in (4, 5, 8, 9):
        batch = m >= max(low, 5)
        assert prep.takes_quantized(m) == (m <= 4)
        x = torch.randn(m, k)
        copy = x.bfloat16().double() @ wt
        assert (_rel(prep.matmul(x.to(DEVICE)), copy) < 1e-4) == batch, m


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default policy needs CUDA")
@pytest.mark.parametrize("name", TYPES)
def test_cuda_policy_picks_triton(name, make_blocks):
    n, k = SHAPES[0]
    _, raw, _ = _case(make_blocks, name, n, k)
    assert prepare_linear(raw, QuantType[name], (n, k)).kind == "triton"
    assert prepare_linear(raw, QuantType[name], (n, k), precise=True).kind == "dequant_tiles"
