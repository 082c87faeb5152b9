"""Batch invariance of the native CPU dots: a token row's outputs have the same bits whatever
the call's row count and wherever the row sits in it, for every type the dots cover. The
linears take token rows in groups (`*_rows`: 4 per decoded weight row, then the rest; `*_tile`:
up to 8 for the 32-value types), so a row meets another kernel form as the count changes: every
form must keep the one-row dot's float order (issue 39: a Q6_K dot in two FMA chains was
suspected of breaking that, and was re-applied once this held for it)."""

import numpy as np
import pytest
import torch

from localllm.kernels.cpu import block_linear
from localllm.kernels.quant import QuantType

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K"]
SUPER = {"IQ4_XS", "Q4_K", "Q5_K", "Q6_K"}  # 256-value super-blocks
ROWS = 17  # two 8-row tiles and one more; four 4-row groups and one more


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    k = block_linear.load(tmp_path_factory.mktemp("row-invariance"))
    if k is None:
        pytest.skip("no C compiler here (the torch paths are used)")
    return k


def _case(name: str, seed: int):
    # 5 super-blocks, or 11 blocks of 32: an odd count takes the dots' tail block
    k = 1280 if name in SUPER else 352
    raw = block_linear.random_blocks(QuantType[name], 23, k, np.random.default_rng(seed))
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(seed))
    return raw, x, k


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_bits_do_not_depend_on_the_row_count_or_its_place(blocks, name):
    raw, x, k = _case(name, 21)
    qt, parts = QuantType[name], block_linear.Parts([raw])
    alone = torch.cat([blocks.rows(parts, qt, k, x[i : i + 1].contiguous(), threads=1)
                       for i in range(ROWS)])  # fmt: skip
    assert alone.abs().max() > 0
    for t in range(2, ROWS + 1):
        for start in sorted({0, ROWS - t, (ROWS - t) // 2}):  # each row at several places
            for threads in (1, 2):
                got = blocks.rows(parts, qt, k, x[start : start + t].contiguous(), threads=threads)
                assert torch.equal(got, alone[start : start + t]), (t, start, threads)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_the_moe_kernels_dense_rows_too(kernels, name):
    """moe_gemv.c's `gemm_rows` (4 rows, then 2, then one per weight row) and its one-row
    `gemv`: the same bits for a row in any of them."""
    raw, x, k = _case(name, 22)
    qt, n = QuantType[name], raw.shape[0]
    alone = torch.stack([kernels.gemv(raw, qt, n, k, x[i], threads=1) for i in range(ROWS)])
    for t in range(1, ROWS + 1):
        for start in sorted({0, ROWS - t}):
            got = kernels.gemm_rows(raw, qt, n, k, x[start : start + t], threads=2)
            assert torch.equal(got, alone[start : start + t]), (t, start)


def test_the_fastest_build_is_the_one_loaded(blocks, tmp_path):
    """`load` refuses a build whose self-check finds a row's bits changed by the row count and
    takes the next flag set (plain C where -march=native goes): the tests above would then pass
    on the slow build. Here the first flag set must be the one in use wherever it builds."""
    built = block_linear.built_libraries(block_linear.SOURCES, block_linear.FLAG_SETS[:1],
                                         "fastest", block_linear._bind, tmp_path)  # fmt: skip
    if next(built, None) is None:
        pytest.skip("the first flag set does not build here")
    assert blocks.flags == block_linear.FLAG_SETS[0]
