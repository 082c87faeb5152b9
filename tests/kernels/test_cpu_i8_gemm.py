"""The int8-activation prompt GEMM (`kernels/cpu/i8_gemm.h`) for every native block type:
activations in llama.cpp's format of each type (Q8_K, Q8_0, Q8_1), its values against the torch
reference of the same math (`gemm_i8_reference`) and near the exact float product, each row's
bits independent of the call's other rows, the parts and the threads, the same bits from a build
without AVX-512 (plain C), `NativeLinear` taking it for prompts with PROMPT_I8, and (where a
llama.cpp CPU build is at hand) llama.cpp's own quantization and dots to float rounding."""

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.kernels.cpu import block_linear
from localllm.kernels.cpu.cbuild import built_libraries, cpu_id
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear import prepare_linear, quant_matmul_reference
from localllm.kernels.quant.linear_native import DECODE_ROWS, NATIVE_MAX_T, PROMPT_I8
from localllm.kernels.quant.prompt_i8 import activation_format, gemm_i8_reference, quantize_q8_k
from tests.kernels.test_cpu_block_linear import TYPES, _rel, _weight

REF_TOL = 1e-6  # the same integers; float32 sums against float64
EXACT_TOL = 5e-2  # int8 activations: ~0.5-1 % off the exact product, ~2.5 % with an outlier per 256


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    k = block_linear.load(tmp_path_factory.mktemp("block-linear-i8"))
    if k is None:
        pytest.skip("no C compiler here (the torch paths are used)")
    return k


def test_formats_are_ggmls_vec_dot_types():
    want = {"Q4_0": "Q8_0", "Q4_1": "Q8_1", "Q5_0": "Q8_0", "Q5_1": "Q8_1", "Q8_0": "Q8_0",
            "IQ4_NL": "Q8_0", "MXFP4": "Q8_0", "IQ4_XS": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K",
            "Q6_K": "Q8_K"}  # fmt: skip
    assert {n: activation_format(QuantType[n]) for n in TYPES} == want


def test_q8_k_takes_the_signed_largest_value():
    """iscale = -127 / max, max the first value of largest magnitude: its code is -127 and the
    scale takes the opposite sign (of two equal magnitudes, the first one sets it)."""
    x = torch.linspace(-1, 1, 512).reshape(1, 512)
    x[0, 3], x[0, 200] = -4.0, 4.0
    x[0, 260], x[0, 400] = 4.0, -4.0
    q, d = quantize_q8_k(x)
    assert (q[0, 0, 3], q[0, 0, 200], q[0, 1, 4], q[0, 1, 144]) == (-127, 127, -127, 127)
    assert d[0, 0, 0] > 0 > d[0, 1, 0] and q.abs().max() <= 127


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("t", [1, 5, 13])
def test_gemm_i8_matches_its_reference(blocks, name, t):
    # n: two tiles of 32 and a ragged one; k: 3 groups of 256 (Q8_K) or 24 of 32, not a
    # multiple of the 6-row step's work; t: padded rows of 6
    n, k = 70, 768
    raw, qt = _weight(name, n, k, t), QuantType[name]
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * 3
    x[0, 5] = 40.0  # an outlier: its group's scale grows, the others' do not
    x[-1, 300] = -41.0  # a negative largest value (Q8_K's scale takes its sign)
    got = blocks.gemm_i8(block_linear.Parts([raw]), qt, k, x)
    assert got.shape == (t, n)
    assert _rel(got, gemm_i8_reference(x, [raw], qt, k)) < REF_TOL
    assert _rel(got, quant_matmul_reference(x, raw, qt, (n, k))) < EXACT_TOL


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_bits_do_not_depend_on_batch_parts_or_threads(blocks, name):
    n, k = 45, 512
    raw, qt = _weight(name, n, k, 3), QuantType[name]
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1))
    one = blocks.gemm_i8(block_linear.Parts([raw]), qt, k, x, threads=2)
    split = block_linear.Parts([raw[:7], raw[7:30], raw[30:]])
    assert torch.equal(blocks.gemm_i8(split, qt, k, x, threads=1), one)
    for i in (0, 4, 10):
        alone = blocks.gemm_i8(split, qt, k, x[i : i + 1].contiguous(), threads=2)
        assert torch.equal(alone[0], one[i])
    assert torch.equal(blocks.gemm_i8(split, qt, k, x[3:9].contiguous()), one[3:9])


def test_zero_rows_give_zeros_and_bad_k_is_refused(blocks):
    n, k = 40, 256
    raw = _weight("Q4_K", n, k, 2)
    x = torch.zeros(3, k)
    x[1] = torch.randn(k, generator=torch.Generator().manual_seed(2))
    got = blocks.gemm_i8(block_linear.Parts([raw]), QuantType.Q4_K, k, x)
    assert torch.equal(got[0], torch.zeros(n)) and torch.equal(got[2], torch.zeros(n))
    q8 = _weight("Q8_0", n, 96, 2)  # k = 96: Q8_0's groups fit, a Q8_K group would not
    got = blocks.gemm_i8(block_linear.Parts([q8]), QuantType.Q8_0, 96, torch.ones(2, 96))
    assert got.shape == (2, n)
    with pytest.raises(MemoryError, match="multiple of its group"):
        blocks.gemm_i8(block_linear.Parts([raw[:, :72]]), QuantType.Q4_K, 128, torch.ones(2, 128))


def test_a_build_without_avx512_gives_the_same_bits(blocks, tmp_path):
    """The vector kernel (vpdpbusd, vector decoding) against the plain C loops: the integer sums
    are exact and the float terms come in the same order, so every value is the same."""
    if "avx512_vnni" not in cpu_id() or "-march=native" not in blocks.flags:
        pytest.skip("the CPU (or the build) has no AVX512-VNNI: one code path here")
    flags = ("-O3", "-fopenmp")
    built = next(built_libraries(block_linear.SOURCES, (flags,), "localllm-block-linear",
                                 block_linear._bind, tmp_path), None)  # fmt: skip
    assert built is not None, "the plain build failed"
    plain = block_linear.BlockKernels(*built)
    n, k = 37, 512
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(4)) * 2
    x[2, 17] = -30.0
    for name in TYPES:
        raw, qt = _weight(name, n, k, 9), QuantType[name]
        parts = block_linear.Parts([raw])
        want = blocks.gemm_i8(parts, qt, k, x)
        assert torch.equal(plain.gemm_i8(parts, qt, k, x, threads=1), want), name


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "IQ4_XS"])
def test_native_linear_prompts_take_int8_rows(kernels, name):
    n, k = 96, 512
    raw, qt = _weight(name, n, k, 6), QuantType[name]
    lin = prepare_linear(raw, qt, (n, k), native=kernels)
    assert lin.kind == "native" and lin.prompt_i8 == PROMPT_I8
    lin.prompt_i8 = True
    t = NATIVE_MAX_T + 3  # past every type's int8 rows
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(6))
    got = lin.matmul(x)
    assert _rel(got, gemm_i8_reference(x, [raw], qt, k)) < REF_TOL
    lin.int8_max_t = 0  # (a model whose decode steps run natively): short calls too, same bits
    for s in (1, 3, DECODE_ROWS):
        assert torch.equal(lin.matmul(x[:s].contiguous()), got[:s])
    lin.prompt_i8 = False  # the exact fp32 tiles (or int16) instead
    assert not torch.equal(lin.matmul(x), got)


def test_self_check_refuses_a_wrong_int8_kernel(blocks):
    class Wrong(block_linear.BlockKernels):
        def gemm_i8(self, parts, qtype, k, x, threads=None):
            return super().gemm_i8(parts, qtype, k, x, threads) * 1.5

    assert block_linear.self_check(blocks)
    assert not block_linear.self_check(Wrong(blocks.lib, blocks.path, blocks.flags))


GGML_CPU = Path(os.environ.get("LOCALLLM_GGML_CPU_LIB", "/work/llama-cpu/build/bin/libggml-cpu.so"))
_GGML_BLOCKS = {8: (32, 34), 9: (32, 36), 15: (256, 292)}  # Q8_0, Q8_1, Q8_K: values, bytes


@pytest.mark.parametrize("name", TYPES)
def test_gemm_i8_equals_ggmls_own_dots(blocks, name):
    """Against llama.cpp's CPU library itself (a build of ngxson/llama.cpp; skipped without one):
    its vec_dot_type's from_float on each activation row, then its vec_dot per weight row. The
    same codes and integer sums: only float32 rounding apart (the exact product: ~5e-3 away)."""
    if not GGML_CPU.exists():
        pytest.skip(f"no libggml-cpu at {GGML_CPU} (set LOCALLLM_GGML_CPU_LIB)")
    lib = ctypes.CDLL(str(GGML_CPU))
    lib.ggml_cpu_init()

    class Traits(ctypes.Structure):
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                    ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]  # fmt: skip

    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    qt = QuantType[name]
    traits = lib.ggml_get_type_traits_cpu(int(qt)).contents
    vt = traits.vec_dot_type
    assert {8: "Q8_0", 9: "Q8_1", 15: "Q8_K"}[vt] == activation_format(qt)
    i64, vp, sz = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
    from_float = ctypes.CFUNCTYPE(None, vp, vp, i64)(
        lib.ggml_get_type_traits_cpu(vt).contents.from_float
    )
    vec_dot = ctypes.CFUNCTYPE(None, ctypes.c_int, vp, sz, vp, sz, vp, sz, ctypes.c_int)(
        traits.vec_dot
    )
    n, k, t = 24, 1024, 3
    raw = _weight(name, n, k, 3)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(5)) * 2
    per, nbytes = _GGML_BLOCKS[vt]
    want = torch.zeros(t, n)
    out = ctypes.c_float()
    for i in range(t):
        q = np.zeros(k // per * nbytes, dtype=np.uint8)
        xi = x[i].contiguous().numpy()
        from_float(xi.ctypes.data, q.ctypes.data, k)
        for j in range(n):
            wr = raw[j].contiguous().numpy()
            vec_dot(k, ctypes.addressof(out), 0, wr.ctypes.data, 0, q.ctypes.data, 0, 1)
            want[i, j] = out.value
    got = blocks.gemm_i8(block_linear.Parts([raw]), qt, k, x)
    assert _rel(got, want) < REF_TOL
    assert _rel(want, quant_matmul_reference(x, raw, qt, (n, k))) > 100 * REF_TOL
