"""Packed (column-major) Q4_K / Q6_K / Q8_0 layouts and their dp4a kernels.

The layout round trip runs everywhere (plain torch). The kernels run on a CUDA device (marked
`gpu`; the real dp4a instruction), or on CPU tensors under TRITON_INTERPRET=1 (the same integer
math without the instruction; small shapes; never in CI, which has no triton).
Tolerances: the GEMV against its oracle `gemv_q8x_reference` (x rounded to int8 codes per 32, W
dequantized by gguf's rules, float64) 1e-5 relative for Q8_0, 2e-4 for the K-quants (float32 sums
with a per-sub-block min term that cancels); against the unrounded x
2e-2 (int8 activations cost ~0.5 % on random data, as in llama.cpp's mmvq); bf16 W^T within bf16
rounding of each value.
"""

import secrets

import numpy as np
import pytest
import torch

from localllm.kernels.quant import QuantType, dequantize
from localllm.kernels.quant.repack import PACKED_TYPES, pack_blocks, unpack_blocks
from tests.triton_env import DEVICE, INTERPRET, needs_triton

NAMES = ["Q4_K", "Q6_K", "Q8_0"]
# GPU adds the Llama-3-8B gate_up shape (28672 rows: many row tiles, no split-K)
SHAPES = [(37, 512)] if INTERPRET else [(37, 512), (4104, 4096), (1000, 14336), (28672, 4096)]


def _case(make_blocks, name, n, k, device="cpu"):
    seed = secrets.randbits(32)
    block = 32 if name == "Q8_0" else 256
    raw = torch.from_numpy(make_blocks(name, n, k // block, np.random.default_rng(seed)))
    return seed, raw.reshape(n, -1).to(device)


def test_packed_types():
    assert {QuantType[n] for n in NAMES} == PACKED_TYPES


@pytest.mark.parametrize("name", NAMES)
def test_pack_round_trip_and_byte_count(name, make_blocks):
    n, k = 37, 512
    _, raw = _case(make_blocks, name, n, k)
    p = pack_blocks(raw, QuantType[name], n, k)
    assert p.nbytes == raw.numel()
    assert torch.equal(unpack_blocks(p), raw)
    # the plane rows really are columns: word 0 of block 0 of row r sits at plane[0, r]
    first = next(iter(p.planes.values()))
    assert first.shape[1] == n


def test_pack_rejects_wrong_sizes(make_blocks):
    _, raw = _case(make_blocks, "Q4_K", 4, 512)
    with pytest.raises(ValueError, match="not a 4x768"):
        pack_blocks(raw, QuantType.Q4_K, 4, 768)
    with pytest.raises(ValueError, match="no packed layout"):
        pack_blocks(raw, QuantType.Q5_K, 4, 512)


def _rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_packed_matches_reference(name, shape, m, make_blocks):
    from localllm.kernels.quant.q8x_reference import gemv_q8x_reference
    from localllm.kernels.quant.triton_packed import gemv_packed

    n, k = shape
    seed, raw = _case(make_blocks, name, n, k, DEVICE)
    qt = QuantType[name]
    x = torch.randn(m, k)
    y = gemv_packed(x.to(DEVICE), pack_blocks(raw, qt, n, k))
    assert y.shape == (m, n) and y.dtype == torch.float32
    # K-quants subtract dmin*m*sum(x) per sub-block in float32: that cancellation costs up to
    # ~5e-5 on long rows of random blocks (1000 x 14336, M = 8 on the H200)
    tol = 1e-5 if name == "Q8_0" else 2e-4
    assert _rel(y, gemv_q8x_reference(x, raw, qt, n, k)) < tol, f"seed {seed}"
    w = dequantize(raw.cpu(), qt).reshape(n, k).double()
    assert _rel(y, x.double() @ w.T) < 2e-2, f"seed {seed}"


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", NAMES)
def test_split_k_uneven_chunks_and_counter_reuse(name, make_blocks):
    """Chunks that do not divide the row (the last program runs past it) and one counter buffer
    over several calls: each call's last program must reset the tile counters it used. Also
    with the loop over a chunk's blocks in cp.async stages (`GEMV_STAGES`; the interpreter runs
    it as a plain loop, a GPU as the pipelined one), and one program for the whole row."""
    from localllm.kernels.quant.q8x_reference import gemv_q8x_reference
    from localllm.kernels.quant.triton_packed import PackedConfig, gemv_packed, split_counters

    n, k = 70, 1280 if name != "Q8_0" else 224  # 5 super-blocks / 7 blocks in chunks of 2 or 3
    seed, raw = _case(make_blocks, name, n, k, DEVICE)
    p = pack_blocks(raw, QuantType[name], n, k)
    nb = k // (32 if name == "Q8_0" else 256)
    configs = (PackedConfig(32, 1, 2), PackedConfig(64, 2, 3), PackedConfig(32, 1, 2, 2),
               PackedConfig(64, 1, 3, 3), PackedConfig(64, 1, nb, 3))  # fmt: skip
    for cfg in configs:
        counters = split_counters(p, cfg)
        for _ in range(3):
            x = torch.randn(2, k)
            y = gemv_packed(x.to(DEVICE), p, cfg, counters)
            ref = gemv_q8x_reference(x, raw, QuantType[name], n, k)
            assert _rel(y, ref) < 1e-5, f"seed {seed} {cfg}"
            assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", NAMES)
def test_dequantize_packed_t(name, make_blocks):
    from localllm.kernels.quant.triton_packed import dequantize_packed_t

    n, k = SHAPES[-1]
    seed, raw = _case(make_blocks, name, n, k, DEVICE)
    wt = dequantize_packed_t(pack_blocks(raw, QuantType[name], n, k))
    assert wt.shape == (k, n) and wt.dtype == torch.bfloat16
    w = dequantize(raw.cpu(), QuantType[name]).reshape(n, k).double()
    ulp = 2.0**-7 if INTERPRET else 2.0**-8  # the interpreter truncates to bf16
    assert ((wt.double().cpu().T - w).abs() <= w.abs() * ulp).all(), f"seed {seed}"


# (value, its group's largest magnitude) pairs whose code sits an ulp from a half: found on the
# H200, where the kernel's correctly rounded 127 / amax and torch's 127 * (1 / amax) disagreed
NEAR_HALVES = [
    (2.03509521484375, 2.3389782905578613, 110),
    (1.3673615455627441, 2.7784788608551025, 62),
    (-1.537031888961792, 3.226496696472168, -60),
    (-1.027890682220459, 2.0239086151123047, -65),
    (1.24170982837677, 2.175133228302002, 73),
    (-1.6232507228851318, 2.051271915435791, -101),
]


def _near_half_rows() -> torch.Tensor:
    x = torch.zeros(len(NEAR_HALVES), 64)
    for i, (v, amax, _) in enumerate(NEAR_HALVES):
        x[i, 0], x[i, 1] = amax, v
    return x


def test_quantize_reference_rounds_near_halves_as_the_kernels():
    """The reference divides as the kernels do (correctly rounded), so codes an ulp from a half
    come out as on the GPU: 110.49999... -> 110, not 111."""
    from localllm.kernels.quant.q8x_reference import quantize_x8_reference

    x = _near_half_rows()
    amax = x[:, :32].abs().amax(1).double()
    codes = torch.round(quantize_x8_reference(x)[:, 1] * 127.0 / amax).tolist()
    assert codes == [float(c) for _, _, c in NEAR_HALVES]


@pytest.mark.gpu
@needs_triton
def test_quantized_x_near_halves_match_reference():
    from localllm.kernels.quant.triton_packed import quantize_x8

    x = _near_half_rows()
    q = quantize_x8(x.to(DEVICE))
    codes = q.words.cpu().contiguous().view(torch.int8).reshape(x.shape)[:, 1].tolist()
    assert codes == [c for _, _, c in NEAR_HALVES]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", NAMES)
def test_quantized_x_matches_reference(name):
    from localllm.kernels.quant.q8x_reference import quantize_x8_reference
    from localllm.kernels.quant.triton_packed import quantize_x8

    x = torch.randn(3, 512) * torch.logspace(-3, 2, 512)  # groups of very different ranges
    x[1, :32] = 0.0  # an all-zero group: scale 0, codes 0
    q = quantize_x8(x.to(DEVICE))
    codes = q.words.cpu().contiguous().view(torch.int8).reshape(3, 512).double()
    xr = quantize_x8_reference(x)
    scale = q.scale.cpu().double().repeat_interleave(32, dim=1)
    assert torch.allclose(codes * scale, xr, rtol=1e-6, atol=0)
    assert codes.abs().max() <= 127 and (codes[1, :32] == 0).all()
    assert torch.equal(q.sum16.cpu(), codes.reshape(3, -1, 16).sum(-1).int())
