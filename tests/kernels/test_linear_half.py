"""F16/BF16 weights in their own dtype (`kernels/quant/linear_half.py`, CUDA's `half_gemm`).

References: `quant_matmul_reference` (the float32 weights, float32 activations) and
`half_matmul_reference` (the activations rounded as the kernel rounds them, float64 sums).
Tolerances, relative (Frobenius norm): against float32, F16 2e-3 (11 significant bits in the
activations, measured ~3e-4) and BF16 1e-2 (8 bits, ~2.5e-3); against the rounded-input
reference 1e-5 on CPU (summation order only) and 1e-3 on CUDA (cuBLAS may reduce split-K
partial sums in half: torch's `allow_fp16/bf16_reduced_precision_reduction` default).
The CUDA tests are marked `gpu`; the CPU ones run the same class through `strategy=`.
"""

import pytest
import torch

from localllm.engine.layers.linear import FusedLinear, QuantLinear
from localllm.kernels.quant import QuantType, linear, prepare_linear, quant_matmul_reference
from localllm.kernels.quant.linear import choose_strategy
from localllm.kernels.quant.linear_half import F16_MAX, half_input, half_matmul_reference
from localllm.offload import QuantWeight

CUDA = torch.cuda.is_available()
VS_FP32 = {"F16": 2e-3, "BF16": 1e-2}
DTYPE = {"F16": torch.float16, "BF16": torch.bfloat16}


def _raw(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DTYPE[name])
    return w.view(torch.uint8).reshape(n, 2 * k)


def _x(t: int, k: int, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)) * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def test_policy_sends_half_weights_to_half_gemm_on_cuda_only(monkeypatch):
    for name in ("F16", "BF16"):
        q = QuantType[name]
        assert choose_strategy(q, (640, 2048), torch.device("cuda")) == "half_gemm"  # default
        assert choose_strategy(q, (640, 2048), torch.device("cpu")) != "half_gemm"
        monkeypatch.setattr(linear, "HALF_GEMM", False)
        assert choose_strategy(q, (640, 2048), torch.device("cuda")) == "dequant_tiles"  # off
        monkeypatch.setattr(linear, "HALF_GEMM", True)
        raw = _raw(name, 16, 64)
        assert prepare_linear(raw, q, (16, 64), strategy="half_gemm").kind == "half_gemm"
        exact = prepare_linear(raw, q, (16, 64), strategy="half_gemm", precise=True)
        assert exact.kind == "dequant_tiles"  # precise keeps float32
    with pytest.raises(ValueError, match="F16 or BF16"):
        prepare_linear(torch.zeros(16, 256, dtype=torch.uint8), QuantType.F32, (16, 64),
                       strategy="half_gemm")  # fmt: skip


@pytest.mark.parametrize("name", ["F16", "BF16"])
@pytest.mark.parametrize("t", [1, 5, 70])
def test_cpu_half_gemm_matches_references(name, t):
    n, k = 96, 256
    raw, q = _raw(name, n, k), QuantType[name]
    prep = prepare_linear(raw, q, (n, k), strategy="half_gemm")
    assert prep.w.data_ptr() == raw.data_ptr()  # the file's values, no copy
    x = _x(t, k)
    y = prep.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (t, n)
    assert rel(y, quant_matmul_reference(x, raw, q, (n, k))) < VS_FP32[name]
    assert rel(y, half_matmul_reference(x, prep.w)) < 1e-5


def test_f16_inputs_beyond_range_saturate_instead_of_inf():
    x = torch.tensor([[1.0, -7e4, 1e5, 65519.0, float("nan")]])
    h = half_input(x, torch.float16)
    assert h[0, :4].tolist() == [1.0, -F16_MAX, F16_MAX, F16_MAX] and h[0, 4].isnan()
    assert half_input(x, torch.bfloat16)[0, 2].item() == pytest.approx(1e5, rel=1e-2)
    x16 = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    assert half_input(x16, torch.float16).tolist() == [1.0, F16_MAX]
    assert x16[1].isinf()  # the caller's half tensor is not written
    n, k = 32, 128
    raw = _raw("F16", n, k, seed=5)
    prep = prepare_linear(raw, QuantType.F16, (n, k), strategy="half_gemm")
    big = _x(3, k, scale=3e4)  # ~4 % of these exceed 65504
    y = prep.matmul(big)
    assert rel(y, half_matmul_reference(big, prep.w)) < 1e-5  # finite, as saturated


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["F16", "BF16"])
@pytest.mark.parametrize("t", [1, 3, 64, 300])
def test_cuda_half_gemm_matches_references(name, t, monkeypatch):
    monkeypatch.setattr(linear, "HALF_GEMM", True)
    n, k = 320, 1152
    q, raw = QuantType[name], _raw(name, n, k, seed=t).cuda()
    prep = prepare_linear(raw, q, (n, k))
    assert prep.kind == "half_gemm" and prep.w.data_ptr() == raw.data_ptr()
    x = _x(t, k, seed=t).cuda()
    y = prep.matmul(x)
    assert y.dtype == torch.float32 and y.is_contiguous() and y.shape == (t, n)
    assert rel(y, quant_matmul_reference(x.cpu(), raw.cpu(), q, (n, k))) < VS_FP32[name]
    assert rel(y, half_matmul_reference(x.cpu(), prep.w.cpu())) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_cuda_half_gemm_through_layers_and_graphs(name, monkeypatch):
    """QuantLinear (bias, 3-D input), a FusedLinear over two parts (one stacked upload), a
    CUDA graph replay (no host sync in the call), saturated F16 inputs: all finite and close."""
    monkeypatch.setattr(linear, "HALF_GEMM", True)
    q, k, dev = QuantType[name], 512, torch.device("cuda")
    parts = []
    for i, n in enumerate((256, 64)):
        lin = QuantLinear(k, n)
        lin.home = dev
        lin.load_tensor("weight", QuantWeight(_raw(name, n, k, seed=10 + i), q, (n, k)))
        lin.bias = torch.randn(n, generator=torch.Generator().manual_seed(i)).to(dev)
        parts.append(lin)
    x = _x(6, k, seed=3).reshape(2, 3, k).to(dev)
    for lin in parts:
        assert lin.kernels()[0].kind == "half_gemm"
        ref = quant_matmul_reference(
            x.reshape(-1, k).cpu(), lin.weight.data.cpu(), q, lin.weight.shape
        )
        y = lin(x)
        assert y.shape == (2, 3, lin.out_features) and y.dtype == torch.float32
        assert rel(y.reshape(-1, lin.out_features) - lin.bias, ref) < VS_FP32[name]
    want = [lin(x) for lin in parts]
    fused = FusedLinear(parts)
    for g, w in zip(fused(x), want, strict=True):
        assert rel(g, w.reshape(g.shape)) < 1e-3  # another GEMM shape: another split-K
    static = x.reshape(-1, k).clone()
    kernel = fused.kernels()[0]
    kernel.matmul(static)  # warm-up (cuBLAS workspace) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.matmul(static)
    static.copy_(_x(6, k, seed=4, scale=3e4).to(dev))  # F16: some inputs saturate
    graph.replay()
    assert rel(out, half_matmul_reference(static.cpu(), kernel.w.cpu())) < 1e-3
