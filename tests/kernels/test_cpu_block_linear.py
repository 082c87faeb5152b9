"""The native block linears (`kernels/cpu/block_linear.c`) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q5_K and Q6_K: their float values against gguf-py's dequantization
(same bits), their int8 dots against the torch reference of the same math (`block_rows_reference`),
each row's bits independent of batch size, parts and threads, the prompt path exact, and fused
projections reading the file's tensors in place (no stacked copy)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import quants

from localllm.kernels.cpu import block_linear
from localllm.kernels.cpu.cbuild import built_libraries, cpu_id
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear import prepare_linear, prepare_parts, quant_matmul_reference
from localllm.kernels.quant.linear_native import (
    DECODE_ROWS,
    GEMM_MIN_ROWS,
    NATIVE_MAX_T,
    block_rows_reference,
)

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "IQ4_XS", "Q4_K", "Q5_K",
         "Q6_K"]  # fmt: skip
REF_TOL = 2e-4  # float32 sums in another order; a code rounded the other way at a tie


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    k = block_linear.load(tmp_path_factory.mktemp("block-linear"))
    if k is None:
        pytest.skip("no C compiler here (the torch paths are used)")
    return k


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _weight(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    return block_linear.random_blocks(QuantType[name], n, k, np.random.default_rng(seed))


@pytest.mark.parametrize("name", TYPES)
def test_c_values_equal_gguf_py(blocks, make_blocks, name):
    k = 512
    raw = make_blocks(name, 40, k // (256 if name in ("IQ4_XS", "Q4_K", "Q5_K", "Q6_K") else 32),
                      np.random.default_rng(7))  # fmt: skip
    want = torch.from_numpy(quants.dequantize(raw, G[name]).astype(np.float32)).reshape(40, k)
    parts = block_linear.Parts([torch.from_numpy(raw[:13]), torch.from_numpy(raw[13:])])
    got = blocks.dequant(parts, QuantType[name], k, 0, 40)
    assert torch.equal(got, want)
    assert torch.equal(blocks.dequant(parts, QuantType[name], k, 11, 29), want[11:29])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("t", [1, 3, 16])
def test_rows_match_the_int8_reference(blocks, name, t):
    n, k = 70, 768
    raw = _weight(name, n, k, t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    got = blocks.rows(block_linear.Parts([raw]), QuantType[name], k, x)
    want = block_rows_reference(x, [raw], QuantType[name], k)
    assert got.shape == (t, n) and _rel(got, want) < REF_TOL
    exact = quant_matmul_reference(x, raw, QuantType[name], (n, k))  # int8 x: ~1 % off
    assert _rel(got, exact) < 3e-2


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_bits_do_not_depend_on_batch_parts_or_threads(blocks, name):
    n, k = 45, 512
    raw = _weight(name, n, k, 3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    one = blocks.rows(block_linear.Parts([raw]), QuantType[name], k, x, threads=2)
    split = block_linear.Parts([raw[:7], raw[7:30], raw[30:]])
    assert torch.equal(blocks.rows(split, QuantType[name], k, x, threads=1), one)
    for i in (0, 4, 8):
        alone = blocks.rows(split, QuantType[name], k, x[i : i + 1].contiguous(), threads=2)
        assert torch.equal(alone[0], one[i])


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q8_0"])
def test_every_row_tile_height_gives_a_row_its_bits_alone(blocks, name):
    """The 32-value block types dot tiles of up to 8 token rows (4 without AVX-512) per decode of a
    weight row: every height, a ragged last tile and an odd block count (the tail block) give
    each row the bits it has alone, at 1 and 2 threads, and the int8 reference's values."""
    n, k = 37, 352
    raw, qt = _weight(name, n, k, 5), QuantType[name]
    parts = block_linear.Parts([raw])
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([blocks.rows(parts, qt, k, x[i : i + 1].contiguous()) for i in range(17)])
    for t in range(2, 18):
        for threads in (1, 2):
            got = blocks.rows(parts, qt, k, x[:t].contiguous(), threads=threads)
            assert torch.equal(got, alone[:t]), (t, threads)
    assert _rel(alone, block_rows_reference(x, [raw], qt, k)) < REF_TOL


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "IQ4_XS", "Q5_K"])
def test_native_linear_exact_rows_blocks_alone(kernels, name):
    n, k = 130, 512
    raw = _weight(name, n, k, 11)
    lin = prepare_linear(raw, QuantType[name], (n, k), native=kernels)
    assert lin.kind == "native" and lin.nbytes == raw.numel()  # the blocks alone
    gen = torch.Generator().manual_seed(5)
    assert lin.int8_max_t == DECODE_ROWS  # types new to these kernels: int8 rows for decode
    x = torch.randn(DECODE_ROWS, k, generator=gen)
    assert _rel(lin.matmul(x), block_rows_reference(x, [raw], QuantType[name], k)) < REF_TOL
    lin.int8_max_t = 0  # (a model whose decode steps run natively): int16 prompts everywhere,
    for shape in ((1, k), (3, k), (2, 5, k), (3, NATIVE_MAX_T, k)):  # or exact float32
        x = torch.randn(*shape, generator=gen)
        want = quant_matmul_reference(x.reshape(-1, k), raw, QuantType[name], (n, k))
        assert _rel(lin.matmul(x).reshape(-1, n), want) < 2e-4  # int16 activations
        lin.prompt_i16 = False
        assert _rel(lin.matmul(x).reshape(-1, n), want) < 1e-6  # float32 sums in another order
        lin.prompt_i16 = True
    raw8 = _weight("Q8_0", n, k, 11)  # Q4_K / Q6_K / Q8_0: int8 rows up to NATIVE_MAX_T
    lin8 = prepare_linear(raw8, QuantType.Q8_0, (n, k), native=kernels)
    x = torch.randn(NATIVE_MAX_T, k, generator=gen)
    assert _rel(lin8.matmul(x), block_rows_reference(x, [raw8], QuantType.Q8_0, k)) < REF_TOL


def test_a_short_prompts_rows_equal_the_same_rows_in_a_longer_call(kernels):
    """A prompt alone and batched with others must leave the same KV cache (the int8 decode
    steps after it would turn any difference into a visible one)."""
    n, k = 300, 576
    lin = prepare_linear(_weight("Q4_1", n, k, 4), QuantType.Q4_1, (n, k), native=kernels)
    lin.int8_max_t = 0  # as in a model whose decode steps run natively
    x = torch.randn(137, k, generator=torch.Generator().manual_seed(8))
    full = lin.matmul(x)
    for t in (1, 2, 4, 14, GEMM_MIN_ROWS, 40):
        assert torch.equal(lin.matmul(x[:t].contiguous()), full[:t]), t


def test_parts_are_read_in_place(kernels):
    k = 256
    q, kk, v = (_weight("Q4_1", n, k, n) for n in (64, 32, 32))
    lin = prepare_parts([q, kk, v], QuantType.Q4_1, (128, k), native=kernels)
    assert [p.data_ptr() for p in lin.parts.parts] == [w.data_ptr() for w in (q, kk, v)]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    want = block_rows_reference(x, [q, kk, v], QuantType.Q4_1, k)
    assert _rel(lin.matmul(x), want) < REF_TOL
    # no kernels, precise math or a type they lack: the caller stacks and prepares as before
    assert prepare_parts([q, kk, v], QuantType.Q4_1, (128, k), native=None) is None
    assert prepare_parts([q, kk, v], QuantType.Q4_1, (128, k), True, kernels) is None
    f16 = torch.zeros(4, 2 * k, dtype=torch.uint8)
    assert prepare_parts([f16], QuantType.F16, (4, k), native=kernels) is None


def test_self_check_refuses_a_wrong_kernel(blocks):
    class Wrong(block_linear.BlockKernels):
        def rows(self, parts, qtype, k, x, threads=None):
            return super().rows(parts, qtype, k, x, threads) * 1.5

    assert block_linear.self_check(blocks)
    assert not block_linear.self_check(Wrong(blocks.lib, blocks.path, blocks.flags))


def test_the_plain_c_build_agrees(blocks, tmp_path):
    """The build for CPUs without AVX2 (no -march): same values, same int8 math."""
    built = block_linear.built_libraries(block_linear.SOURCES, (("-O2",),), "plain",
                                         block_linear._bind, tmp_path)  # fmt: skip
    lib, path, flags = next(built)
    plain = block_linear.BlockKernels(lib, path, flags)
    assert block_linear.self_check(plain)
    for name in TYPES:
        raw = _weight(name, 33, 512, 2)
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
        parts = block_linear.Parts([raw])
        got = plain.rows(parts, QuantType[name], 512, x)
        assert _rel(got, block_rows_reference(x, [raw], QuantType[name], 512)) < REF_TOL, name
        assert torch.equal(plain.dequant(parts, QuantType[name], 512, 0, 33),
                           blocks.dequant(parts, QuantType[name], 512, 0, 33))  # fmt: skip


@pytest.mark.parametrize("name", TYPES)
def test_a_build_without_vnni_gives_the_same_bits(blocks, tmp_path, name):
    """The dots sum their products with AVX512-VNNI (dpbusd, and dpwssd for the K-quant scales)
    where the CPU has it, with maddubs / madd / add elsewhere: the same integers (no 16-bit sum
    can saturate), so a build without VNNI gives every row the same bits, at 1 and 5 rows."""
    if "avx512_vnni" not in cpu_id() or "-march=native" not in blocks.flags:
        pytest.skip("the CPU (or the build) has no AVX512-VNNI: one code path here")
    flags = (*block_linear.FLAG_SETS[0], "-mno-avx512vnni")
    built = next(built_libraries(block_linear.SOURCES, (flags,), "no-vnni", block_linear._bind,
                                 tmp_path), None)  # fmt: skip
    assert built is not None, "the build without VNNI failed"
    plain = block_linear.BlockKernels(*built)
    n, k = 37, 512
    raw = _weight(name, n, k, 9)
    parts = block_linear.Parts([raw])
    for t in (1, 5):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        want = blocks.rows(parts, QuantType[name], k, x, threads=1)
        assert torch.equal(plain.rows(parts, QuantType[name], k, x, threads=1), want), t
