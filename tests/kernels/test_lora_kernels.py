"""The LoRA shrink/expand kernels (`kernels.fused.triton_lora`) against their torch reference
(`kernels.fused.lora_delta`): one, two and three output parts, ranks that are not powers of two,
row counts from one to the kernels' limit, float16 and float32 weights, strided part outputs (the
views a fused linear hands over) and rows on no adapter (factor 0: the output unchanged).
Runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 with CPU tensors."""

import pytest
import torch

from localllm.kernels.fused.lora_delta import LoraPart, shrink_expand_reference
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS

CASES = [  # (rows, in, part outputs, part ranks, weight dtype)
    (1, 96, [40], [16], torch.float32),
    (3, 600, [64, 24, 24], [16, 32, 8], torch.float16),
    (5, 1100, [200, 72], [48, 48], torch.float32),
    (64, 130, [33], [5], torch.float16),
]


def _case(rows, k, outs, ranks, dtype, seed=0):
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
    base = torch.randn(rows, sum(outs) + 7, generator=g)  # parts are column views of one tensor
    return x, a, w, parts, base


def _views(base, outs):
    return list(base[:, : sum(outs)].split(outs, dim=1))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-{len(c[2])}parts")
def test_kernels_match_reference(case):
    from localllm.kernels.fused.triton_lora import shrink_expand, usable

    rows, outs = case[0], case[2]
    x, a, w, parts, base = _case(*case)
    want = base.clone()
    shrink_expand_reference(x, a, w, parts, _views(want, outs))
    x, a, w, base = (t.to(DEVICE) for t in (x, a, w, base))
    parts = [LoraPart(p.lo, p.hi, p.b_t.to(DEVICE)) for p in parts]
    got = base.clone()
    ys = _views(got, outs)
    assert usable(x, parts, ys)
    shrink_expand(x, a, w, parts, ys)
    got = got.cpu()
    if rows > 1:
        assert torch.equal(got[1], want[1])  # factor 0: untouched
    assert torch.equal(got[:, sum(outs) :], want[:, sum(outs) :])  # past the parts: untouched
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    assert (got - base.cpu()).abs().max().item() > 1e-2  # the delta is really there
