"""kernels.attention: bidirectional spans (Gemma 3's image tokens) in paged attention.

The reference is float64 attention with transformers' Gemma 3 rule written out per pair of
positions from token-type groups (`get_block_sequence_ids_for_mask` + `blockwise_overlay`): key j
is visible to query i when (j <= i or both carry the same image group) and, on a sliding-window
layer, j > i - window. The paged side reads random non-contiguous tables over a NaN-filled pool
(tests/kernels/test_paged_attention.py's `build`).
"""

import math

import pytest
import torch

from localllm.kernels.attention import paged_attention, plan_decode
from tests.kernels.test_paged_attention import F32_TOL, build


def groups_of(n: int, spans) -> torch.Tensor:
    """Per position its image group id, -1 for text (what token_type_ids give transformers)."""
    g = torch.full((n,), -1)
    for i, (a, b) in enumerate(spans):
        g[a:b] = i
    return g


def reference(q, k, v, scale, spans, window=None):
    t, h, _ = q.shape
    n, kvh, _ = k.shape
    heads = torch.arange(h) // (h // kvh)
    q, k, v = q.double(), k.double()[:, heads], v.double()[:, heads]
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    g = groups_of(n, spans)
    qpos = torch.arange(n - t, n)[:, None]
    keys = torch.arange(n)[None, :]
    same = (g[qpos] == g[keys]) & (g[qpos] >= 0)
    allowed = (keys <= qpos) | same
    if window:
        allowed &= keys > qpos - window
    return torch.einsum("htn,nhd->thd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


# (context after the step, new tokens, spans): a whole prompt with two images; a chunk that
# starts inside an image (a prefix-cache hit ending there); a decode step after an image; a chunk
# that holds one image after text already computed
CASES = (
    (40, 40, ((5, 21), (24, 30))),
    (33, 14, ((12, 28),)),
    (30, 1, ((3, 19),)),
    (50, 30, ((25, 45),)),
)


@pytest.mark.parametrize("window", [None, 6, 64])
@pytest.mark.parametrize("block_size", [16, 5])
def test_spans_match_the_token_type_reference(window, block_size):
    seqs = tuple((n, t) for n, t, _ in CASES)
    spans = tuple(s for _, _, s in CASES)
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(seqs, block_size, 4, 2, 16, 16, seed=7)
    scale = 0.3
    got = paged_attention(q, kc, vc, starts, lens, tables, scale, window, spans=spans)
    assert torch.isfinite(got).all()
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs, strict=True)):
        want = reference(qb, kb, vb, scale, spans[b], window)
        err = (got[starts[b] : starts[b + 1]].double() - want).abs().max().item()
        assert err < F32_TOL, f"sequence {b}: {err:.2e}"
        if len(qb) > 1:  # the spans change the answer: ignoring them could not pass
            causal = reference(qb, kb, vb, scale, (), window)
            assert (causal - want).abs().max() > 100 * F32_TOL


def test_spans_with_a_decode_plan():
    """A batch of decode rows and a prompt chunk (the batched decode path beside the chunk)."""
    seqs = ((30, 1), (40, 20), (17, 1))
    spans = ((), ((22, 38),), ())
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(seqs, 8, 4, 2, 16, 16, seed=11)
    plan = plan_decode(starts, lens, tables, 8, None)
    got = paged_attention(q, kc, vc, starts, lens, tables, 0.25, decode=plan, spans=spans)
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs, strict=True)):
        want = reference(qb, kb, vb, 0.25, spans[b])
        assert (got[starts[b] : starts[b + 1]].double() - want).abs().max() < F32_TOL
