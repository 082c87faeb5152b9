"""Q4_0 / Q5_0 / IQ4_NL blocks widened to Q8_0 (`kernels.quant.widen`): gguf-py dequantizes the
widened blocks to the very floats it dequantizes the originals to; packed experts and the CUDA
linear path take the widened form (GLM-4.5-Air Q4_K_M's 1408-wide Q5_0 `ffn_down_exps`).
Kernel tests run on CUDA (marked `gpu`) or on CPU tensors under TRITON_INTERPRET=1; the linear
against gguf-py's dequantized weight in float64 within 2e-2 relative (x is rounded to int8)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from localllm.kernels.moe import ExpertFormat
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear import choose_strategy, prepare_linear
from localllm.kernels.quant.repack import pack_expert_blocks
from localllm.kernels.quant.widen import widen_blocks, widened_nbytes
from tests.perf.make_synthetic import random_rows
from tests.triton_env import DEVICE, needs_triton

NAMES = ("Q4_0", "Q5_0", "IQ4_NL")


def _raw(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name != "IQ4_NL":
        return random_rows(QT[name], rows, k, rng)
    raw = rng.integers(0, 256, size=(rows * k // 32, 18), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, raw.shape[0]).astype(np.float16) / np.float16(60.0 * np.sqrt(k))
    raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", NAMES)
def test_widened_blocks_dequantize_to_the_same_floats(name):
    raw = _raw(name, 48, 1408, 3)
    wide = widen_blocks(torch.from_numpy(raw), QuantType[name]).numpy()
    assert wide.shape == (48, 1408 // 32 * 34)
    assert widened_nbytes(QuantType[name], raw.nbytes) == wide.nbytes
    want = quants.dequantize(raw, QT[name])
    got = quants.dequantize(wide, QT.Q8_0)
    assert np.abs(want).max() > 0 and np.array_equal(got, want)


def test_other_types_are_not_widened():
    assert widened_nbytes(QuantType.Q4_K, 144 * 5) == 144 * 5
    with pytest.raises(ValueError, match="Q4_K blocks are not widened"):
        widen_blocks(torch.zeros(1, 144, dtype=torch.uint8), QuantType.Q4_K)


def test_q5_0_experts_pack_as_their_q8_0_blocks():
    raw = torch.from_numpy(np.stack([_raw("Q5_0", 64, 1408, s) for s in range(3)]))
    got = pack_expert_blocks(raw, QuantType.Q5_0, 64, 1408)
    want = pack_expert_blocks(widen_blocks(raw, QuantType.Q5_0), QuantType.Q8_0, 64, 1408)
    assert got.qtype == QuantType.Q8_0 and got.planes.keys() == want.planes.keys()
    for f in want.planes:
        assert torch.equal(got.planes[f], want.planes[f]), f


@needs_triton  # (kernels.moe.packed imports the kernels)
def test_glm_air_expert_format_is_packable_widened():
    from localllm.kernels.moe.packed import packable

    fmt = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q5_0, 4096, 1408, "silu")
    assert packable(fmt, widen=True)
    assert not packable(fmt)  # (slot pools fill planes byte for byte: the packed types alone)
    q51 = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q5_1, 4096, 1408, "silu")
    assert not packable(q51, widen=True)


@pytest.mark.gpu
@needs_triton
def test_q5_0_linear_takes_the_triton_path_widened():
    n, k = 96, 1408
    raw = _raw("Q5_0", n, k, 7)
    assert choose_strategy(QuantType.Q5_0, (n, k), "cuda") == "triton"
    lin = prepare_linear(torch.from_numpy(raw).to(DEVICE), QuantType.Q5_0, (n, k),
                         strategy="triton")  # fmt: skip
    assert lin.kind == "triton" and lin.qtype == QuantType.Q8_0 and lin.repacked
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    w = torch.from_numpy(quants.dequantize(raw, QT.Q5_0)).double()
    want = x.double() @ w.T
    got = lin.matmul(x.to(DEVICE)).double().cpu()
    assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.gpu
@needs_triton
def test_q5_0_linear_packs_natively_with_the_switch(monkeypatch):
    """`widen.NATIVE_Q5_0`: a dense Q5_0 linear (GLM-4.5-Air's shared expert down) packs as
    stored (22 bytes a block), its GEMV rows equal the widened linear's bit for bit; 12 rows (no
    batch GEMM for Q5_0: the bf16 path) within the int8-free tolerance of the float64 product."""
    from localllm.kernels.quant import widen

    n, k = 96, 1408
    raw = _raw("Q5_0", n, k, 8)
    dev = torch.from_numpy(raw).to(DEVICE)
    wide = prepare_linear(dev, QuantType.Q5_0, (n, k), strategy="triton")
    monkeypatch.setattr(widen, "NATIVE_Q5_0", True)
    lin = prepare_linear(dev, QuantType.Q5_0, (n, k), strategy="triton")
    assert lin.qtype == QuantType.Q5_0 and lin.packed.qtype == QuantType.Q5_0
    assert lin.nbytes == raw.nbytes and wide.nbytes == raw.nbytes // 22 * 34
    w = torch.from_numpy(quants.dequantize(raw, QT.Q5_0)).double()
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        assert lin.takes_quantized(rows)
        assert torch.equal(lin.matmul(x), wide.matmul(x))
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(12))
    got = lin.matmul(x.to(DEVICE)).double().cpu()
    want = x.double() @ w.T
    assert ((got - want).norm() / want.norm()).item() < 1e-2
