"""The recurrent layers' decode step on the state slots (`kernels/recurrent/decode.py`): the
slot-indexed references against the per-sequence ones, and the triton kernels against the
references are `test_recurrent_triton.py`'s. Random inputs, slots out of order, a fresh sequence
whose slot holds garbage."""

import pytest
import torch

from localllm.kernels.recurrent.causal_conv import causal_conv_step
from localllm.kernels.recurrent.decode import conv_decode_ref, gated_delta_decode_ref
from localllm.kernels.recurrent.delta_rule import delta_rule_step_ref, l2_normalize

TOL = 2e-5  # float32, other summation orders
EPS = 1e-6
SHAPES = [(2, 4, 8, 8), (2, 4, 128, 128), (3, 3, 24, 40)]  # Hk, Hv, Dk, Dv (the 80B: 16 32 128 128)


def delta_inputs(hk, hv, dk, dv, device="cpu", seed=0):
    """3 sequences in slots 3, 1 (fresh, NaN inside) and 0 of 5."""
    gen = torch.Generator().manual_seed(seed)
    b, s = 3, 5
    q, k = torch.randn(b, hk, dk, generator=gen), torch.randn(b, hk, dk, generator=gen)
    v = torch.randn(b, hv, dv, generator=gen)
    g, beta = -torch.rand(b, hv, generator=gen), torch.rand(b, hv, generator=gen)
    states = torch.randn(s, hv, dk, dv, generator=gen)
    states[1] = float("nan")  # the fresh sequence's slot: its old contents are never read
    slots, fresh = torch.tensor([3, 1, 0]), torch.tensor([False, True, False])
    return [t.to(device) for t in (q, k, v, g, beta, states, slots, fresh)]


@pytest.mark.parametrize("shape", SHAPES)
def test_delta_decode_ref_is_the_per_sequence_rule(shape):
    q, k, v, g, beta, states, slots, fresh = delta_inputs(*shape)
    before = states.clone()
    out = gated_delta_decode_ref(q, k, v, g, beta, states, slots, fresh, EPS)
    rep = shape[1] // shape[0]
    for i, slot in enumerate(slots.tolist()):
        s = torch.zeros_like(before[slot]) if fresh[i] else before[slot].clone()
        qn = l2_normalize(q[i], EPS).repeat_interleave(rep, 0) * shape[2] ** -0.5
        kn = l2_normalize(k[i], EPS).repeat_interleave(rep, 0)
        o = delta_rule_step_ref(qn[None], kn[None], v[i : i + 1], g[i : i + 1], beta[i : i + 1],
                                s[None])  # fmt: skip
        assert (out[i] - o[0]).abs().max() < TOL
        assert (states[slot] - s).abs().max() < TOL
    assert torch.equal(states[[2, 4]], before[[2, 4]])  # other slots untouched


def conv_inputs(c=40, kk=4, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(3, c, generator=gen), torch.randn(c, kk, generator=gen)
    states = torch.randn(5, kk - 1, c, generator=gen)
    states[1] = float("inf")
    slots, fresh = torch.tensor([3, 1, 0]), torch.tensor([False, True, False])
    return [t.to(device) for t in (x, w, states, slots, fresh)]


def test_conv_decode_ref_is_the_step():
    x, w, states, slots, fresh = conv_inputs()
    before = states.clone()
    y = conv_decode_ref(x, w, states, slots, fresh)
    own = before[[3, 1, 0]].clone()
    own[1] = 0
    want = torch.nn.functional.silu(causal_conv_step(x, w, own, silu=False))
    assert (y - want).abs().max() < TOL and torch.equal(states[[3, 1, 0]], own)
