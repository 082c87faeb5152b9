"""The LoRA kernels against their torch reference (`kernels.fused.lora_delta`), each scheme:
`triton_lora` (two launches, the default) and `triton_lora_fused` (one launch, a grid barrier).
One, two and three output parts, several
adapters stacked per part (ranks 8, 16, 64 and ones that are not powers of two), row counts from
one (the broadcast path) to the kernels' limit (tl.dot), float16, bfloat16 and float32 weights,
float16 outputs, strided part outputs (the views a fused linear hands over) and rows on no
adapter (factor 0: the output unchanged). The scratch must be back at zero after each call: a
second call adds the same delta again.
Runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 with CPU tensors."""

import pytest
import torch

from localllm.kernels.fused.lora_delta import LoraPart, scratch, shrink_expand_reference
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS

CASES = [  # (rows, in, part outputs, part ranks, weight dtype[, output dtype])
    (1, 96, [40], [16], torch.float32),
    (1, 300, [48, 16, 16], [32, 32, 16], torch.bfloat16),  # q/k/v, two rank-16 adapters on q, k
    (1, 260, [24, 24], [64, 64], torch.float16, torch.float16),  # gate/up, rank 64
    (3, 600, [64, 24, 24], [16, 32, 8], torch.float16),
    (4, 200, [40, 40], [32, 32], torch.bfloat16),  # four rank-8 adapters per part
    (5, 1100, [200, 72], [48, 48], torch.float32),
    (64, 130, [33], [5], torch.float16),
]
SCHEMES = ["atomic", "fused"]


def _case(rows, k, outs, ranks, dtype, ydtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = sum(ranks)
    x = torch.randn(rows, k, generator=g)
    a = (0.1 * torch.randn(r, k, generator=g)).to(dtype)
    w = torch.randn(rows + 3, r, generator=g)
    if rows > 1:
        w[1] = 0.0  # a row on no adapter
    parts, lo = [], 0
    for n, rank in zip(outs, ranks, strict=True):
        parts.append(LoraPart(lo, lo + rank, (0.1 * torch.randn(rank, n, generator=g)).to(dtype)))
        lo += rank
    if rows > 2:
        w[2, : r // 2] = 0.0  # a row on the later adapters only
    # parts are column views of one tensor
    base = torch.randn(rows, sum(outs) + 7, generator=g).to(ydtype)
    return x, a, w, parts, base


def _views(base, outs):
    return list(base[:, : sum(outs)].split(outs, dim=1))


def _run(scheme, x, a, w, parts, ys, scratch):
    if scheme == "fused":
        from localllm.kernels.fused.triton_lora_fused import shrink_expand

        shrink_expand(x, a, w, parts, ys, scratch)
    else:
        from localllm.kernels.fused.triton_lora import shrink_expand

        shrink_expand(x, a, w, parts, ys, scratch)


def _tol(want: torch.Tensor) -> float:
    rel = 1e-4 if want.dtype == torch.float32 else 2e-3  # a float16 output's rounding
    return rel * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-{len(c[2])}parts-{c[4]}")
def test_kernels_match_reference(case, scheme):
    from localllm.kernels.fused.triton_lora import usable

    rows, outs = case[0], case[2]
    x, a, w, parts, base = _case(*case)
    want = base.clone()
    shrink_expand_reference(x, a, w, parts, _views(want, outs))
    x, a, w, base = (t.to(DEVICE) for t in (x, a, w, base))
    parts = [LoraPart(p.lo, p.hi, p.b_t.to(DEVICE)) for p in parts]
    got = base.clone()
    ys = _views(got, outs)
    assert usable(x, parts, ys)
    acc, count = pad = scratch(a.shape[0], DEVICE)
    _run(scheme, x, a, w, parts, ys, pad)
    assert not acc.any() and not count.any()  # left at zero for the next call
    got = got.cpu()
    base = base.cpu()
    if rows > 1:
        assert torch.equal(got[1], want[1])  # factor 0: untouched
    assert torch.equal(got[:, sum(outs) :], want[:, sum(outs) :])  # past the parts: untouched
    assert (got.float() - want.float()).abs().max().item() < _tol(want)
    assert (got.float() - base.float()).abs().max().item() > 1e-2  # the delta is really there


@pytest.mark.parametrize("scheme", SCHEMES)
def test_second_call_adds_the_same_delta(scheme):
    """The scratch the first call used is clean: calling twice adds the delta twice."""
    case = CASES[3]
    x, a, w, parts, base = _case(*case, seed=1)
    want = base.clone()
    for _ in range(2):
        shrink_expand_reference(x, a, w, parts, _views(want, case[2]))
    x, a, w = (t.to(DEVICE) for t in (x, a, w))
    parts = [LoraPart(p.lo, p.hi, p.b_t.to(DEVICE)) for p in parts]
    got = base.to(DEVICE)
    pad = scratch(a.shape[0], DEVICE)
    for _ in range(2):
        _run(scheme, x, a, w, parts, _views(got, case[2]), pad)
    assert (got.cpu() - want).abs().max().item() < _tol(want)
