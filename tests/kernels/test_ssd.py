"""The Mamba-2 scan (`kernels/recurrent/ssd.py`) against transformers' torch fallbacks of
GraniteMoeHybrid (`mamba2_chunk_scan`, `mamba2_selective_state_update`) and against itself: the
chunked prefill equals the token-by-token scan for any block size, from any carried state, and
a prompt in pieces equals it whole. Random inputs (fixed seeds), float32 throughout."""

import pytest
import torch
import torch.nn.functional as F

from localllm.kernels.recurrent.ssd import ssd_chunked, ssd_scan, ssd_step, ssd_step_ref

gm = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")

TOL = 2e-5  # float32, other summation orders


def inputs(t: int, h: int = 4, p: int = 8, g: int = 2, n: int = 6, seed: int = 0):
    """x, dt (softplus of a raw step: > 0), A (< 0), B, C, a nonzero state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, p, generator=gen)
    dt = F.softplus(torch.randn(t, h, generator=gen))
    a = -torch.rand(h, generator=gen) - 0.05
    b = torch.randn(t, g, n, generator=gen)
    c = torch.randn(t, g, n, generator=gen)
    state = 0.5 * torch.randn(h, p, n, generator=gen)
    return x, dt, a, b, c, state


@pytest.mark.parametrize("t", [1, 5, 17, 40])
def test_chunked_prefill_matches_transformers(t):
    x, dt, a, b, c, state = inputs(t)
    want, want_state = gm.mamba2_chunk_scan(
        x[None], dt[None], a, b[None], c[None], chunk_size=16,
        initial_states=state[None].clone(), return_final_states=True,
    )  # fmt: skip
    s = state.clone()
    got = ssd_chunked(x, dt, a, b, c, s, chunk=8)
    assert (got - want[0]).abs().max() < TOL
    assert (s - want_state[0]).abs().max() < TOL


def test_step_matches_transformers():
    x, dt, a, b, c, state = inputs(3)
    h, p, n = state.shape
    want_state = state[None].repeat(3, 1, 1, 1)
    want = gm.mamba2_selective_state_update(
        want_state, x, dt[..., None].expand(-1, -1, p), a[:, None, None].expand(h, p, n), b, c
    )
    s = state[None].repeat(3, 1, 1, 1)
    got = ssd_step(x, dt, a, b, c, s)
    assert (got - want).abs().max() < TOL and (s - want_state).abs().max() < TOL


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_equals_scan_from_a_carried_state(chunk):
    x, dt, a, b, c, state = inputs(23, seed=1)
    s1, s2 = state.clone(), state.clone()
    want = ssd_scan(x, dt, a, b, c, s1)
    got = ssd_chunked(x, dt, a, b, c, s2, chunk=chunk)
    assert (got - want).abs().max() < TOL and (s1 - s2).abs().max() < TOL


def test_prompt_in_pieces_equals_whole():
    x, dt, a, b, c, state = inputs(20, seed=2)
    whole_state = state.clone()
    whole = ssd_chunked(x, dt, a, b, c, whole_state)
    s = state.clone()
    parts = [
        ssd_chunked(x[i:j], dt[i:j], a, b[i:j], c[i:j], s) for i, j in ((0, 7), (7, 8), (8, 20))
    ]
    assert (torch.cat(parts) - whole).abs().max() < TOL and (s - whole_state).abs().max() < TOL


def test_state_matters():
    """A carried state changes the outputs (a scan that ignored it could not pass the above)."""
    x, dt, a, b, c, state = inputs(6, seed=3)
    with_state = ssd_step_ref(x[:1], dt[:1], a, b[:1], c[:1], state[None].clone())
    fresh = ssd_step_ref(x[:1], dt[:1], a, b[:1], c[:1], torch.zeros_like(state)[None])
    assert (with_state - fresh).abs().max() > 0.1
