"""MoE kernels: fast routing vs the softmax-top-k recipe, grouped expert FFN vs the dense oracle."""

import gguf
import numpy as np
import pytest
import torch

from localllm.kernels.moe import (
    ExpertBlocks,
    ExpertFormat,
    expert_ffn_grouped,
    expert_ffn_reference,
    group_by_expert,
    route_topk,
    route_topk_reference,
)
from localllm.kernels.quant import QuantType

E, D, H = 8, 64, 32


@pytest.mark.parametrize("norm", [True, False])
def test_fast_routing_matches_reference(norm):
    logits = 3 * torch.randn(50, E, generator=torch.Generator().manual_seed(0))
    w, ids = route_topk(logits, 2, norm)
    w_ref, ids_ref = route_topk_reference(logits, 2, norm)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(50))
    else:
        assert (w.sum(-1) < 1).all()


def test_group_by_expert_orders_pairs():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    order, experts, counts = group_by_expert(ids)
    assert experts == [0, 1, 2, 3] and counts == [1, 2, 1, 2]
    assert ids.reshape(-1)[order].tolist() == [0, 1, 1, 2, 3, 3]


def _experts(qtype: QuantType, seed: int):
    """Random expert tensors as raw ggml blocks: gate/up [E, H, rb], down [E, D, rb]."""
    rng = np.random.default_rng(seed)

    def raw(rows, cols):
        arr = (rng.standard_normal((E, rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if qtype == QuantType.F32:
            return torch.from_numpy(arr.view(np.uint8).copy())
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType(int(qtype)))
        return torch.from_numpy(q.copy())

    return raw(H, D), raw(H, D), raw(D, H)


@pytest.mark.parametrize("qtype", [QuantType.F32, QuantType.Q8_0, QuantType.Q4_0])
@pytest.mark.parametrize("tokens", [1, 37])
def test_grouped_matches_dense_reference(qtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    gate, up, down = _experts(qtype, tokens)
    fmt = ExpertFormat(qtype, qtype, qtype, D, H)
    x = torch.randn(tokens, D, generator=gen)
    w, ids = route_topk(torch.randn(tokens, E, generator=gen), 2, True)
    fetched = []

    def fetch(e):
        fetched.append(e)
        return ExpertBlocks(gate[e], up[e], down[e])

    got = expert_ffn_grouped(x, w, ids, fetch, fmt)
    want = expert_ffn_reference(x, w, ids, gate, up, down, fmt)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32, summation order only
    # only the selected experts were touched, each once, in ascending order
    assert fetched == sorted(set(ids.reshape(-1).tolist()))


def test_grouped_ignores_unselected_experts():
    """Corrupting an expert no token picked cannot change the output (and must not be read)."""
    gate, up, down = _experts(QuantType.F32, 1)
    fmt = ExpertFormat(QuantType.F32, QuantType.F32, QuantType.F32, D, H)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]])
    w = torch.full((4, 2), 0.5)

    def fetch(e):
        assert e in (0, 1), f"expert {e} was not routed to"
        return ExpertBlocks(gate[e], up[e], down[e])

    before = expert_ffn_grouped(x, w, ids, fetch, fmt)
    gate[5].fill_(255)
    assert torch.equal(expert_ffn_grouped(x, w, ids, fetch, fmt), before)
