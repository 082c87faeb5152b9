"""Fused decoder steps: the triton kernels against the plain-torch references.

The references run everywhere; the kernels on CUDA (marked `gpu`) or under TRITON_INTERPRET=1
(CPU tensors; never in CI, which has no triton). Tolerance: float32 sums in another order, 1e-5
relative (RMSNorm) and 1e-6 (SiLU product, elementwise).
"""

import pytest
import torch
import torch.nn.functional as F

from localllm.kernels.fused import WeightedRows, add_rms_norm, add_rms_norm_q, rms_norm, silu_mul
from tests.kernels.int8_rows import assert_int8_rows_of
from tests.triton_env import DEVICE, needs_triton


def test_references_match_the_unfused_formulas():
    x, r, w = torch.randn(3, 96), torch.randn(3, 96), torch.rand(96) + 0.5
    s, h = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r)
    ref = (x + r) * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(h, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6))
    gu = torch.randn(4, 2 * 40)
    assert torch.equal(silu_mul(gu, 40), F.silu(gu[:, :40]) * gu[:, 40:])


def test_weighted_rows_reference_sums_k_rows_per_row():
    """A MoE layer's pending output (k expert rows per token and their weights) added by the
    norm: on CPU it is summed first, the same as adding the float64 weighted sum."""
    gen = torch.Generator().manual_seed(3)
    y, wts = torch.randn(3 * 4, 96, generator=gen), torch.rand(3, 4, generator=gen)
    x, w = torch.randn(3, 96, generator=gen), torch.rand(96, generator=gen) + 0.5
    want = torch.einsum("tk,tkd->td", wts.double(), y.double().view(3, 4, 96))
    pending = WeightedRows(y, wts)
    torch.testing.assert_close(pending.total().double(), want, rtol=1e-6, atol=1e-6)
    s, h, xq = add_rms_norm_q(x, pending, w, 1e-6)
    assert xq is None and torch.equal(s, x + pending.total())
    assert torch.equal(h, add_rms_norm(x, pending.total(), w, 1e-6)[1])


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("rows", "k", "d"), [(1, 8, 2048), (3, 2, 576), (2, 4, 4096)])
@pytest.mark.parametrize("shared", [False, True])
def test_triton_norm_adds_weighted_rows(rows, k, d, shared):
    """The norm kernel summing k rows per row itself (decode's MoE output): the sum in the
    order the Triton weighted sum takes, so the stream equals x + `combine_cuda` bit for bit;
    the norm and its quantized twin as for a plain residual. `shared`: a shared experts' row
    added after the sum (`moe.block.SHARED_IN_NORM`), as `combine` then `+ shared` add it."""
    from localllm.kernels.fused.triton_ops import add_rms_norm_cuda
    from localllm.kernels.moe.triton_combine import combine_cuda

    gen = torch.Generator().manual_seed(rows * k + d)
    x, y = torch.randn(rows, d, generator=gen) * 3, torch.randn(rows * k, d, generator=gen)
    wts, w = torch.rand(rows, k, generator=gen), torch.rand(d, generator=gen) + 0.5
    e = torch.randn(rows, d, generator=gen) if shared else torch.zeros(rows, d)
    dx, dy, dwts, dw, de = (t.to(DEVICE) for t in (x, y, wts, w, e))
    re = de if shared else None
    s, h, xq = add_rms_norm_cuda(dx, dy, dw, 1e-5, quant=True, rw=dwts, re=re)
    assert torch.equal(s, dx + (combine_cuda(dy, dwts) + de if shared else combine_cuda(dy, dwts)))
    if shared:  # and through the CPU-side dispatch of a pending MoE output
        pending = WeightedRows(dy, dwts, de)
        got = add_rms_norm_q(dx, pending, dw, 1e-5)[0]  # (CPU tensors: `total`, then the add)
        if DEVICE == "cuda":
            assert torch.equal(got, s)
        torch.testing.assert_close(got, s, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(pending.total(), combine_cuda(dy, dwts) + de)
    want = x.double() + e.double()
    want += torch.einsum("tk,tkd->td", wts.double(), y.double().view(rows, k, d))
    torch.testing.assert_close(s.cpu().double(), want, rtol=1e-6, atol=1e-5)
    assert torch.allclose(h.cpu(), F.rms_norm(s.cpu(), (d,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert_int8_rows_of(xq, h)
    with pytest.raises(ValueError, match="do not hold"):
        add_rms_norm_cuda(dx, dy[:-1], dw, 1e-5, rw=dwts)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("d", [64, 576, 4096])
def test_triton_rms_norm_and_residual(d):
    from localllm.kernels.fused.triton_ops import add_rms_norm_cuda, rms_norm_cuda

    x, r = torch.randn(5, d) * 3, torch.randn(5, d)
    w = torch.rand(d) + 0.5
    dx, dr, dw = (t.to(DEVICE) for t in (x, r, w))
    got, none = rms_norm_cuda(dx, dw, 1e-5)
    assert none is None
    assert torch.allclose(got.cpu(), F.rms_norm(x, (d,), w, 1e-5), rtol=1e-5, atol=1e-6)
    s, h, _ = add_rms_norm_cuda(dx, dr, dw, 1e-5)
    assert torch.equal(s.cpu(), x + r)
    assert torch.allclose(h.cpu(), F.rms_norm(x + r, (d,), w, 1e-5), rtol=1e-5, atol=1e-6)
    # with the quantized twin: the same float output, and exactly what quantize_x8 makes of it
    got_q, xq = rms_norm_cuda(dx, dw, 1e-5, quant=True)
    assert torch.equal(got_q, got)
    assert_int8_rows_of(xq, got_q)
    s_q, h_q, xq = add_rms_norm_cuda(dx, dr, dw, 1e-5, quant=True)
    assert torch.equal(s_q, s) and torch.equal(h_q, h)
    assert_int8_rows_of(xq, h_q)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("k", [0, 6])
def test_triton_norm_scales_the_residual(k):
    """Granite's residual scale (`granitehybrid.FUSED_RESIDUAL`): x + s * r, or s times the
    weighted sum of k rows, against float64; the CPU path is x.add(r, alpha=s) itself."""
    from localllm.kernels.fused.triton_ops import add_rms_norm_cuda

    d, rows, sc = 1536, 3, 0.22
    gen = torch.Generator().manual_seed(k)
    x, r = torch.randn(rows, d, generator=gen) * 3, torch.randn(rows * max(k, 1), d, generator=gen)
    wts, w = torch.rand(rows, k, generator=gen), torch.rand(d, generator=gen) + 0.5
    rw = wts.to(DEVICE) if k else None
    s, h, xq = add_rms_norm_cuda(x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-5, True, rw=rw,
                                 scale=sc)  # fmt: skip
    summed = torch.einsum("tk,tkd->td", wts.double(), r.double().view(rows, k, d)) if k else r
    want = x.double() + sc * summed.double()
    torch.testing.assert_close(s.cpu().double(), want, rtol=1e-6, atol=1e-5)
    assert torch.allclose(h.cpu(), F.rms_norm(s.cpu(), (d,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert_int8_rows_of(xq, h)
    cpu = add_rms_norm_q(x, r if not k else WeightedRows(r, wts), w, 1e-5, scale=sc)[0]
    assert torch.equal(cpu, x.add(r if not k else WeightedRows(r, wts).total(), alpha=sc))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("d", [2048, 576])
def test_triton_gated_add_sums_the_gate_logit(d):
    """`qwen3next.FUSED_NORMS`' block end: x + y + sigmoid(h . gw) * s with the logit summed in
    the kernel (each of a row's programs sums it whole), against float64 and the CPU form."""
    from localllm.kernels.fused.ops import gated_add_dot
    from localllm.kernels.fused.triton_ops import gated_add_cuda

    gen = torch.Generator().manual_seed(d)
    x, y, s, h = (torch.randn(3, d, generator=gen) for _ in range(4))
    gw = torch.randn(1, d, generator=gen) / d**0.5
    got = gated_add_cuda(*(t.to(DEVICE) for t in (x, y, s)), gw.to(DEVICE), h.to(DEVICE))
    g = torch.sigmoid(h.double() @ gw.double().t())
    want = x.double() + y.double() + g * s.double()
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-5)
    cpu = gated_add_dot(x, y, s, h, gw)
    torch.testing.assert_close(cpu.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("hidden", [40, 1536, 14336, 1056])
def test_triton_silu_mul(hidden):
    from localllm.kernels.fused.triton_ops import silu_mul_cuda

    gu = torch.randn(3, 2 * hidden) * 4
    got, none = silu_mul_cuda(gu.to(DEVICE), hidden)
    assert none is None
    ref = F.silu(gu[:, :hidden]) * gu[:, hidden:]
    assert torch.allclose(got.cpu(), ref, rtol=1e-6, atol=1e-6)
    got_q, xq = silu_mul_cuda(gu.to(DEVICE), hidden, quant=True)
    assert torch.equal(got_q, got)
    if hidden % 32:  # rows that do not split into 32-value groups are not quantized
        assert xq is None
    else:
        assert_int8_rows_of(xq, got_q)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("d", [40, 2048, 3000])
def test_triton_gated_add(d):
    """Qwen3-Next's block end in one launch: x + y + sigmoid(g) * s, g one value a row."""
    from localllm.kernels.fused import ops
    from localllm.kernels.fused.triton_ops import gated_add_cuda

    gen = torch.Generator().manual_seed(d)
    x, y, s = (torch.randn(3, d, generator=gen) for _ in range(3))
    g = 3 * torch.randn(3, 1, generator=gen)
    ref = ops.gated_add(x, y, s, g)  # (CPU tensors: the torch formula)
    got = gated_add_cuda(*(t.to(DEVICE) for t in (x, y, s, g)))
    assert torch.allclose(got.cpu(), ref, rtol=1e-6, atol=1e-6)
