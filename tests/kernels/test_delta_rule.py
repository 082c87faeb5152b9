"""The gated delta rule and the causal short conv (`kernels/recurrent`) against transformers'
torch fallbacks of Qwen3-Next (`torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`,
`causal_conv1d_fn`, `causal_conv1d_update`) and against each other: the chunked prefill equals the
token-by-token scan for any block size, from any carried state; the conv's prefill in pieces
equals one call and the step. Random inputs (fixed seeds), float32 throughout."""

import pytest
import torch

from localllm.kernels.recurrent.causal_conv import causal_conv_prefill, causal_conv_step
from localllm.kernels.recurrent.delta_rule import (
    delta_rule_blocks,
    delta_rule_chunked,
    delta_rule_scan,
    delta_rule_step,
    delta_rule_step_ref,
    l2_normalize,
)

qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOL = 2e-5  # float32, other summation orders (measured below 2e-6 on these sizes)


def inputs(t: int, h: int = 4, dk: int = 8, dv: int = 16, seed: int = 0):
    """q, k (normalised, q scaled), v, g (log decay in (-1.5, 0)), beta, a nonzero state."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, h, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=gen))
    v = torch.randn(t, h, dv, generator=gen)
    g = -1.5 * torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    state = 0.5 * torch.randn(h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def hf(fn, q, k, v, g, beta, state, **kw):
    """transformers' function on our layout (batch 1, q already normalised and scaled: its own
    scaling is undone by passing q * sqrt(Dk), no l2 norm asked)."""
    dk = q.shape[-1]
    out, s = fn(
        (q * dk**0.5)[None], k[None], v[None], g=g[None], beta=beta[None],
        initial_state=state[None].clone(), output_final_state=True, **kw,
    )  # fmt: skip
    return out[0], s[0]


def err(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("t", [1, 7, 64, 150])
def test_scan_matches_transformers_recurrent(t):
    q, k, v, g, beta, s0 = inputs(t)
    state = s0.clone()
    out = delta_rule_scan(q, k, v, g, beta, state)
    want, want_state = hf(qn.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    assert out.abs().max() > 0.1  # something flows
    assert err(out, want) < TOL and err(state, want_state) < TOL


@pytest.mark.parametrize("t", [1, 7, 64, 150])
def test_chunked_matches_transformers_chunked(t):
    q, k, v, g, beta, s0 = inputs(t, seed=1)
    state = s0.clone()
    out = delta_rule_chunked(q, k, v, g, beta, state)
    want, want_state = hf(qn.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0)
    assert err(out, want) < TOL and err(state, want_state) < TOL


@pytest.mark.parametrize("form", [delta_rule_chunked, delta_rule_blocks])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunked_equals_scan_for_any_block(chunk, form):
    """Both chunked forms (per block; two phases, as on CUDA) equal the scan, padded or not."""
    q, k, v, g, beta, s0 = inputs(100, seed=2)
    s_scan, s_chunk = s0.clone(), s0.clone()
    want = delta_rule_scan(q, k, v, g, beta, s_scan)
    got = form(q, k, v, g, beta, s_chunk, chunk=chunk)
    assert err(got, want) < TOL and err(s_chunk, s_scan) < TOL


def test_state_carries_across_calls():
    """A prompt in three pieces (the state between them is all that is carried) equals one
    call; without the carried state the rest differs by far more than the tolerance."""
    q, k, v, g, beta, s0 = inputs(90, seed=3)
    whole = delta_rule_chunked(q, k, v, g, beta, s0.clone())
    state, parts = s0.clone(), []
    for a, e in ((0, 13), (13, 14), (14, 90)):
        parts.append(delta_rule_chunked(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], state))
    assert err(torch.cat(parts), whole) < TOL
    fresh = delta_rule_chunked(q[14:], k[14:], v[14:], g[14:], beta[14:], torch.zeros_like(s0))
    assert err(fresh, whole[14:]) > 100 * TOL


def test_step_batches_sequences():
    """One decode step of 3 sequences equals each sequence's own step."""
    seqs = [inputs(1, seed=10 + i) for i in range(3)]
    q, k, v, g, beta = (torch.cat([s[j] for s in seqs]) for j in range(5))
    states = torch.stack([s[5] for s in seqs])
    out = delta_rule_step(q, k, v, g, beta, states)
    for i, (qi, ki, vi, gi, bi, si) in enumerate(seqs):
        alone = si.clone()[None]
        assert err(out[i], delta_rule_step_ref(qi, ki, vi, gi, bi, alone)[0]) < TOL
        assert err(states[i], alone[0]) < TOL


def conv_inputs(t: int, c: int = 24, kk: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, c, generator=gen), torch.randn(c, kk, generator=gen) / 2


@pytest.mark.parametrize("silu", [True, False])
def test_conv_prefill_matches_transformers(silu):
    x, w = conv_inputs(20)
    state = torch.zeros(3, 24)
    got = causal_conv_prefill(x, w, state, silu=silu)
    want = qn.causal_conv1d_fn(x.t()[None], w, None, activation="silu" if silu else None)
    assert err(got, want[0].t()) < TOL
    assert torch.equal(state, x[-3:])  # the last K - 1 inputs, oldest first


def test_conv_pieces_and_steps_equal_one_call():
    x, w = conv_inputs(20, seed=1)
    whole = causal_conv_prefill(x, w, torch.zeros(3, 24))
    state, parts = torch.zeros(3, 24), []
    for a, e in ((0, 2), (2, 9)):  # a piece shorter than the state, then a longer one
        parts.append(causal_conv_prefill(x[a:e], w, state))
    batched = state[None].repeat(2, 1, 1)  # two sequences with the same history
    for t in range(9, 20):
        y = causal_conv_step(x[t : t + 1].repeat(2, 1), w, batched)
        parts.append(y[:1])
        assert err(y[0], y[1]) < TOL
    assert err(torch.cat(parts), whole) < TOL


def test_conv_step_matches_transformers_update():
    x, w = conv_inputs(1, seed=2)
    gen = torch.Generator().manual_seed(3)
    hist = torch.randn(3, 24, generator=gen)
    ours = hist[None].clone()
    got = causal_conv_step(x, w, ours)
    theirs = hist.t()[None].contiguous()  # transformers keeps [B, C, K - 1] here
    want = qn.causal_conv1d_update(x[:, :, None], theirs, w, None, activation="silu")
    assert err(got, want[:, :, 0]) < TOL
    assert err(ours[0], theirs[0].t()) == 0
