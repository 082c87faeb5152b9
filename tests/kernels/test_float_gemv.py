"""The native few-row float GEMV (`kernels/cpu/float_gemv.c`) against its torch reference: every
row count, float32 and bfloat16 weights, a bias, a short last block, and sums that do not depend
on the thread count."""

import pytest
import torch

from localllm.kernels.cpu import float_gemv


@pytest.fixture(scope="module")
def gemv(tmp_path_factory):
    g = float_gemv.load(tmp_path_factory.mktemp("float_gemv"))
    if g is None:
        pytest.skip("no C compiler here: callers keep torch")
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_float_gemv_matches_the_torch_reference(gemv, dtype, m):
    gen = torch.Generator().manual_seed(m)
    n, k = 203, 320  # 203: the last block of output rows is short
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    assert gemv.supports(x, w)
    want = float_gemv.linear_reference(x, w, bias)
    got = gemv.linear(x, w, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv.linear(x, w), float_gemv.linear_reference(x, w),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_float_gemv_sums_do_not_depend_on_threads(gemv):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 512, generator=gen), torch.randn(999, 512, generator=gen)
    assert torch.equal(gemv.linear(x, w, threads=1), gemv.linear(x, w, threads=2))


def test_float_gemv_refuses_what_it_does_not_compute(gemv):
    w = torch.randn(8, 64)
    assert not gemv.supports(torch.randn(5, 64), w)  # more rows than the kernel holds
    assert not gemv.supports(torch.randn(2, 64).double(), w)
    assert not gemv.supports(torch.randn(2, 40), torch.randn(8, 40))  # k not a lane multiple
    assert not gemv.supports(torch.randn(64, 2).T, w)  # not contiguous
