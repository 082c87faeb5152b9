"""The fused routing (`triton_route`: decode's `route_topk_cuda`, prompts' `topk_softmax_cuda`)
against `route_topk` on the float32 logits of the same router: same experts in the same order,
weights within float32 rounding. Runs on CUDA (marked `gpu`) or on CPU tensors under
TRITON_INTERPRET=1."""

import pytest
import torch

from localllm.kernels.moe import route_topk
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize(("n_expert", "k", "dim"), [(8, 2, 64), (128, 8, 2048), (60, 4, 96)])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_route_topk_cuda_matches_torch(n_expert, k, dim, tokens, norm):
    from localllm.kernels.moe.triton_route import route_topk_cuda

    gen = torch.Generator().manual_seed(n_expert * 100 + tokens)
    x = torch.randn(tokens, dim, generator=gen)
    w = torch.randn(n_expert, dim, generator=gen) / dim**0.5
    weights, ids = route_topk_cuda(x.to(DEVICE), w.to(DEVICE), k, norm)
    want_w, want_ids = route_topk(x.double() @ w.double().T, k, norm)
    assert ids.dtype == torch.int64 and weights.shape == (tokens, k)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w.float(), rtol=1e-5, atol=1e-6)


def test_exact_ties_pick_the_lowest_expert():
    from localllm.kernels.moe.triton_route import route_topk_cuda

    w = torch.zeros(16, 32)
    w[[3, 9, 12], 0] = 1.0  # experts 3, 9 and 12 tie for first place
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0
    weights, ids = route_topk_cuda(x.to(DEVICE), w.to(DEVICE), 4, True)
    assert ids.cpu().tolist() == [[3, 9, 12, 0]]  # then the lowest of the zero logits
    assert torch.allclose(weights.cpu()[0, :3], weights.cpu()[0, :1].expand(3))


@pytest.mark.parametrize(("n_expert", "k"), [(128, 8), (60, 4), (256, 8)])
@pytest.mark.parametrize("norm", [True, False])
def test_prompt_topk_softmax_matches_torch(n_expert, k, norm):
    from localllm.kernels.moe.triton_route import topk_softmax_cuda

    gen = torch.Generator().manual_seed(n_expert + k)
    logits = torch.randn(300, n_expert, generator=gen) * 3  # a prompt's rows, past the GEMV's 8
    weights, ids = topk_softmax_cuda(logits.to(DEVICE), k, norm)
    want_w, want_ids = route_topk(logits, k, norm)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("n_expert", "k", "rows"), [(32, 4, 1), (160, 8, 3), (128, 8, 300)])
def test_topk_scored_matches_route_scored(scoring, with_bias, norm, n_expert, k, rows):
    """GLM-4.5's / LFM2-MoE's routing (`route_scored` without groups: the choice shifted by a
    bias, the unbiased scores of the chosen weighted, renormalised or not, times a scale) in
    one launch: the same experts in the same order, weights within float32 rounding; decode
    rows through the router GEMV kernel, a prompt's from given logits."""
    from localllm.kernels.moe import route_scored
    from localllm.kernels.moe.triton_route import router_logits_cuda, topk_scored_cuda

    gen = torch.Generator().manual_seed(n_expert + rows)
    bias = torch.randn(n_expert, generator=gen) * 0.3 if with_bias else None
    dev_bias = None if bias is None else bias.to(DEVICE)
    if rows <= 8:
        x = torch.randn(rows, 64, generator=gen)
        w = torch.randn(n_expert, 64, generator=gen) / 8
        logits = router_logits_cuda(x.to(DEVICE), w.to(DEVICE))
        want_logits = x.double() @ w.double().T
        torch.testing.assert_close(logits.cpu().double(), want_logits, rtol=1e-5, atol=1e-5)
    else:
        logits = (torch.randn(rows, n_expert, generator=gen) * 2).to(DEVICE)
    weights, ids = topk_scored_cuda(logits, k, scoring, dev_bias, norm, 2.5)
    want_w, want_ids = route_scored(logits.cpu(), k, scoring, bias, 1, 1, norm, 2.5)
    assert ids.dtype == torch.int64 and weights.shape == (rows, k)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-5, atol=1e-6)
