"""Grouped expert GEMMs for MoE prefill (`kernels.moe.grouped`): the device-side sort against a
plain-Python grouping, the kernels against a float64 oracle (activations rounded to int8 per 32
as the kernels take them, gguf-dequantized weights), and a pair's bits independent of which
other pairs share its launch.

Sorting runs on any device. Kernel tests run on CUDA (marked `gpu`) or on CPU tensors under
TRITON_INTERPRET=1. Tolerances as the decode GEMVs' (`test_triton_packed`): the integer sums are
exact, the float scaling per 32 values rounds (1e-5 Q8_0; K-quants 2e-4, where Q4_K's minimum
term cancels much of the sum).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.quant import QuantType
from localllm.kernels.quant.repack import pack_expert_blocks
from tests.perf.make_synthetic import random_rows
from tests.triton_env import DEVICE, needs_triton


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize(("pairs", "n_expert", "bm"), [(1, 4, 16), (40, 6, 16), (300, 5, 32)])
def test_sort_pairs_groups_every_pair_once_by_expert(pairs, n_expert, bm):
    from localllm.kernels.moe.pairs import sort_pairs

    gen = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, n_expert - 1, (pairs,), generator=gen)  # the last expert gets none
    sp = sort_pairs(ids, n_expert, bm)
    rows, experts = sp.rows.view(-1, bm).tolist(), sp.experts.tolist()
    assert len(rows) == len(experts)
    seen = []
    for block, e in zip(rows, experts, strict=True):
        real = [r for r in block if r >= 0]
        if e < 0:
            assert not real
            continue
        assert real and block[: len(real)] == real  # padding only at a block's end
        assert all(ids[r] == e for r in real)
        seen += real
    assert seen == sorted(range(pairs), key=lambda r: (int(ids[r]), r))
    used = [e for e in experts if e >= 0]
    assert used == sorted(used) and n_expert - 1 not in used


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("pairs", "n_expert", "bm"),
    [(1, 4, 16), (40, 6, 16), (300, 5, 32), (4096, 128, 64), (1000, 256, 16), (9000, 128, 64)],
)
def test_sort_pairs_cuda_equals_the_torch_sort(pairs, n_expert, bm):
    from localllm.kernels.moe.pairs import sort_pairs
    from localllm.kernels.moe.triton_pairs import sort_pairs_cuda

    gen = torch.Generator().manual_seed(pairs + n_expert)
    # skewed routing (a few hot experts, some unused), as a real router's
    hot = torch.randint(0, n_expert, (pairs,), generator=gen) % max(1, n_expert // 3)
    ids = torch.where(
        torch.rand(pairs, generator=gen) < 0.5,
        hot,
        torch.randint(0, n_expert, (pairs,), generator=gen),
    )
    want = sort_pairs(ids, n_expert, bm)
    for dtype in (torch.int64, torch.int32):
        got = sort_pairs_cuda(ids.to(DEVICE, dtype), n_expert, bm)
        assert (got.bm, got.pairs) == (want.bm, want.pairs)
        assert torch.equal(got.rows.cpu(), want.rows.cpu())
        assert torch.equal(got.experts.cpu(), want.experts.cpu())


def _experts(name: str, e: int, n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([random_rows(QT[name], n, k, rng) for _ in range(e)]))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize(("k", "adiv", "bm"), [(256, 1, 16), (512, 2, 32)])
def test_grouped_gemm_matches_reference(name, k, adiv, bm):
    from localllm.kernels.moe.grouped import grouped_gemm, grouped_gemm_reference
    from localllm.kernels.moe.pairs import sort_pairs
    from localllm.kernels.quant.triton_packed import quantize_x8

    e, n, pairs = 4, 72, 38  # N not a multiple of the tile, an expert without rows
    qt = QuantType[name]
    raw = _experts(name, e, n, k, k + bm)
    p = pack_expert_blocks(raw.to(DEVICE), qt, n, k)
    gen = torch.Generator().manual_seed(k)
    a = torch.randn(pairs // adiv, k, generator=gen)
    ids = torch.randint(0, e - 1, (pairs,), generator=gen)
    sp = sort_pairs(ids.to(DEVICE), e, bm)
    got = grouped_gemm(quantize_x8(a.to(DEVICE)), sp, p, adiv)
    want = grouped_gemm_reference(a, ids, raw, qt, adiv)
    assert got.shape == (pairs, n) and want.abs().max() > 0.1
    assert _rel(got, want) < (1e-5 if name == "Q8_0" else 2e-4)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_a_pairs_bits_do_not_depend_on_its_launch(name):
    """The rows of one expert computed alone (a one-expert launch over its planes only) equal
    the same rows computed among every expert's pairs, bit for bit."""
    from localllm.kernels.moe.grouped import grouped_gemm
    from localllm.kernels.moe.pairs import sort_pairs
    from localllm.kernels.quant.triton_packed import quantize_x8

    e, n, k, pairs = 5, 64, 512, 70
    qt = QuantType[name]
    raw = _experts(name, e, n, k, 7)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(pairs, k, generator=gen).to(DEVICE)
    ids = torch.randint(0, e, (pairs,), generator=gen).to(DEVICE)
    every = pack_expert_blocks(raw.to(DEVICE), qt, n, k)
    got = grouped_gemm(quantize_x8(a), sort_pairs(ids, e, 32), every, 1)
    for x in range(e):
        mine = (ids == x).nonzero().view(-1)
        one = pack_expert_blocks(raw[x : x + 1].to(DEVICE), qt, n, k)
        zero = torch.zeros(mine.numel(), dtype=torch.int64, device=DEVICE)
        alone = grouped_gemm(quantize_x8(a[mine]), sort_pairs(zero, 1, 32), one, 1)
        assert torch.equal(alone, got[mine]), x
