"""FusedLinear over parts of one or several ggml types (Q4_K_M's q/k in Q4_K beside a Q6_K v):
every part's output equals its own QuantLinear's, on CPU and on CUDA (where the groups share one
quantization of the input, also one handed over by the norm kernel).

Tolerance: the stacked kernel sums in another order than the separate one (1e-5 relative on
CPU; 1e-4 on CUDA, where split-K depends on the stacked row count).
"""

import numpy as np
import pytest
import torch

from localllm.engine.layers.linear import FusedLinear, QuantLinear
from localllm.engine.layers.shared import RMSNorm
from localllm.kernels.fused import QUANT_MAX_ROWS
from localllm.kernels.quant import QuantType
from localllm.offload import QuantWeight
from tests.kernels.conftest import random_blocks

CUDA = torch.cuda.is_available()
K = 512


def _linear(qtype: str, n: int, seed: int, device: str, bias: bool = False) -> QuantLinear:
    data = torch.from_numpy(random_blocks(qtype, n, K // 256, np.random.default_rng(seed)))
    lin = QuantLinear(K, n)
    lin.load_tensor("weight", QuantWeight(data.to(device), QuantType[qtype], (n, K)))
    if bias:
        b = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(device)
        lin.bias = b
    return lin


def _parts(device: str, bias: bool):
    spec = [("Q4_K", 256), ("Q4_K", 64), ("Q6_K", 64)]
    return [_linear(t, n, i, device, bias) for i, (t, n) in enumerate(spec)]


def _check(device: str, rows: int, bias: bool, rtol: float):
    ref = _parts(device, bias)
    fused = FusedLinear(_parts(device, bias))
    assert len(fused.kernels()) == 2  # q+k stacked, v alone
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(7)).to(device)
    want = [lin(x) for lin in ref]
    got = fused(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * w.abs().max().item())
    return fused, x


@pytest.mark.parametrize("bias", [False, True])
def test_mixed_types_equal_separate_linears_cpu(bias):
    fused, _ = _check("cpu", 3, bias, 1e-5)
    with pytest.raises(ValueError, match="one ggml type"):
        fused.project(torch.zeros(1, K))


def test_fusable_rules():
    parts = _parts("cpu", False)
    assert not FusedLinear.fusable(parts) and FusedLinear.fusable(parts, mixed=True)
    assert FusedLinear.fusable(parts[:2])
    other = QuantLinear(2 * K, 64)
    assert not FusedLinear.fusable([parts[0], other], mixed=True)  # not loaded


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 3, 9, 33])  # 9, 33: the bf16 GEMM path
@pytest.mark.parametrize("bias", [False, True])
def test_mixed_types_equal_separate_linears_cuda(rows, bias):
    fused, x = _check("cuda", rows, bias, 1e-4)
    # a quantized twin from the norm kernel gives the same result as quantizing inside
    norm = RMSNorm(K, 1e-6)
    norm.weight = torch.rand(K, device="cuda") + 0.5
    h, hq = norm.forward_q(x)
    assert (hq is not None) == (rows <= QUANT_MAX_ROWS)
    for a, b in zip(fused(h, hq), fused(h), strict=True):
        assert torch.equal(a, b)
