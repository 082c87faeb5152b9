"""The int16-activation prompt GEMM (`kernels/cpu/i16_gemm.h`) for every native block type: its
values against the torch reference of the same math (`gemm_i16_reference`) and near the exact
float product, each row's bits independent of the call's other rows, the parts and the threads,
the same bits from a build without AVX-512 (plain C), and `NativeLinear` taking it for prompts."""

import pytest
import torch

from localllm.kernels.cpu import block_linear
from localllm.kernels.cpu.cbuild import built_libraries, cpu_id
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear import prepare_linear, quant_matmul_reference
from localllm.kernels.quant.linear_native import (
    DECODE_ROWS,
    NATIVE_MAX_T,
    PROMPT_I16,
    gemm_i16_reference,
)
from tests.kernels.test_cpu_block_linear import TYPES, _rel, _weight

REF_TOL = 1e-6  # the same integers; float32 sums against float64
EXACT_TOL = 2e-4  # int16 activations: ~4e-5 off the exact product on Gaussian rows


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    k = block_linear.load(tmp_path_factory.mktemp("block-linear-i16"))
    if k is None:
        pytest.skip("no C compiler here (the torch paths are used)")
    return k


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("t", [1, 5, 13])
def test_gemm_i16_matches_its_reference(blocks, name, t):
    n, k = 70, 768  # n: two tiles of 32 and a ragged one; t: padded rows of 4 and 6
    raw, qt = _weight(name, n, k, t), QuantType[name]
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * 3
    x[0, 5] = 40.0  # an outlier: its group's scale grows, the others' do not
    got = blocks.gemm_i16(block_linear.Parts([raw]), qt, k, x)
    assert got.shape == (t, n)
    assert _rel(got, gemm_i16_reference(x, [raw], qt, k)) < REF_TOL
    assert _rel(got, quant_matmul_reference(x, raw, qt, (n, k))) < EXACT_TOL


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_bits_do_not_depend_on_batch_parts_or_threads(blocks, name):
    n, k = 45, 512
    raw, qt = _weight(name, n, k, 3), QuantType[name]
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1))
    one = blocks.gemm_i16(block_linear.Parts([raw]), qt, k, x, threads=2)
    split = block_linear.Parts([raw[:7], raw[7:30], raw[30:]])
    assert torch.equal(blocks.gemm_i16(split, qt, k, x, threads=1), one)
    for i in (0, 4, 10):
        alone = blocks.gemm_i16(split, qt, k, x[i : i + 1].contiguous(), threads=2)
        assert torch.equal(alone[0], one[i])
    assert torch.equal(blocks.gemm_i16(split, qt, k, x[3:9].contiguous()), one[3:9])


def test_zero_rows_give_zeros(blocks):
    n, k = 40, 256
    raw = _weight("Q4_K", n, k, 2)
    x = torch.zeros(3, k)
    x[1] = torch.randn(k, generator=torch.Generator().manual_seed(2))
    got = blocks.gemm_i16(block_linear.Parts([raw]), QuantType.Q4_K, k, x)
    assert torch.equal(got[0], torch.zeros(n)) and torch.equal(got[2], torch.zeros(n))


def test_a_build_without_avx512_gives_the_same_bits(blocks, tmp_path):
    """The vector kernel (vpdpwssd, vector decoding) against the plain C loops: the integer sums
    are exact and the float terms come in the same order, so every value is the same."""
    if "avx512_vnni" not in cpu_id() or "-march=native" not in blocks.flags:
        pytest.skip("the CPU (or the build) has no AVX512-VNNI: one code path here")
    flags = ("-O3", "-fopenmp")
    built = next(built_libraries(block_linear.SOURCES, (flags,), "localllm-block-linear",
                                 block_linear._bind, tmp_path), None)  # fmt: skip
    assert built is not None, "the plain build failed"
    plain = block_linear.BlockKernels(*built)
    n, k = 37, 512
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(4))
    for name in TYPES:
        raw, qt = _weight(name, n, k, 9), QuantType[name]
        parts = block_linear.Parts([raw])
        want = blocks.gemm_i16(parts, qt, k, x)
        assert torch.equal(plain.gemm_i16(parts, qt, k, x, threads=1), want), name


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "IQ4_XS"])
def test_native_linear_prompts_take_int16_rows(kernels, name):
    n, k = 96, 512
    raw, qt = _weight(name, n, k, 6), QuantType[name]
    lin = prepare_linear(raw, qt, (n, k), native=kernels)
    assert lin.kind == "native" and lin.prompt_i16 == PROMPT_I16
    lin.prompt_i16 = True
    gen = torch.Generator().manual_seed(6)
    t = NATIVE_MAX_T + 3  # past every type's int8 rows
    x = torch.randn(t, k, generator=gen)
    got = lin.matmul(x)
    assert _rel(got, gemm_i16_reference(x, [raw], qt, k)) < REF_TOL
    lin.int8_max_t = 0  # (a model whose decode steps run natively): short calls too, same bits
    for s in (1, 3, DECODE_ROWS):
        assert torch.equal(lin.matmul(x[:s].contiguous()), got[:s])
    lin.prompt_i16 = False  # the exact fp32 tiles instead
    want = quant_matmul_reference(x, raw, qt, (n, k))
    assert _rel(lin.matmul(x), want) < 1e-6


def test_self_check_refuses_a_wrong_int16_kernel(blocks):
    class Wrong(block_linear.BlockKernels):
        def gemm_i16(self, parts, qtype, k, x, threads=None):
            return super().gemm_i16(parts, qtype, k, x, threads) * 1.5

    assert block_linear.self_check(blocks)
    assert not block_linear.self_check(Wrong(blocks.lib, blocks.path, blocks.flags))
