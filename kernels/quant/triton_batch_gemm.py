"""Triton GEMMs for batched decode (9-64 rows) over packed Q4_K, Q6_K and Q8_0 blocks.

Past the GEMVs' few rows a packed linear used to expand its whole weight into a bf16 copy per
call and hand it to cuBLAS: at 16-64 rows that copy (written, then read back) is most of a decode
step's memory traffic. Here each program expands its own [32, BN] weight tile in registers, by
the same float32 formulas as `triton_unpack` (each value rounded once to bf16), and multiplies it
with the activation rows on bf16 tensor cores, so the weight's bytes are read once and nothing
is written but the output. Activations are bf16 [M, K]; programs split K (grid axis 1) and each
writes its partial sums [M, N] of one split to its own slice, which the host adds in a fixed
order (no atomics: a call's bits do not depend on scheduling).

Program (n, split, m): weight rows n*BN.., super-blocks (blocks for Q8_0) split*SB.., activation
rows m*BM... One flat loop (32 values a step; 64 for Q4_K, both nibbles of the words it loads)
lets the software pipeliner prefetch every load (`triton_grouped`'s finding). Layouts:
`repack.PackedBlocks`; host side: `batch_gemm`. M and SB are not specialized on (triton would
compile again for a row count that 16 does not divide: a stall mid-serving, after the warm-up).
"""

import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import _plane, _q4k_header
from localllm.kernels.quant.triton_unpack import _affine, _q6k_quarter_codes, _split


@triton.jit
def _tile_start(M, N, NB, SB, BM: tl.constexpr, BN: tl.constexpr):
    """This program's activation rows, weight rows, their masks, its split index, and the first
    and count of the (super-)blocks of K it sums (the last split may hold fewer)."""
    rows = tl.program_id(2) * BM + tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    b0 = split * SB
    return rows, rows < M, cols, cols < N, split, b0, tl.minimum(SB, NB - b0)


@triton.jit
def _x_tile(x_ptr, rows, rm, K, k0):
    """Activation values [BM, 32] at K offset k0 (bf16, as the host rounded them)."""
    kk = k0 + tl.arange(0, 32)
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=rm[:, None], other=0)


@triton.jit
def _codes(u, bias: tl.constexpr):
    """Small unsigned integers u (< 2^23) minus `bias`, as float32, exactly: u's bits under the
    exponent of 2^23 make the float 2^23 + u, and one subtraction removes both offsets. An or and
    a subtraction instead of an int-to-float conversion, which runs at a quarter of the rate."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _mma(acc, x, w, HALF: tl.constexpr):
    """acc + x @ w, w [32, BN] float32 rounded to bf16 first. HALF: bf16 tensor cores (CUDA);
    else the same bf16 values multiplied in float32 (the interpreter's bf16 dot is wrong)."""
    if HALF:
        return tl.dot(x, w.to(tl.bfloat16), acc)
    return tl.dot(x.to(tl.float32), w.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _store_split(out_ptr, acc, split, rows, rm, cols, cm, M, N):
    o = out_ptr + (split * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(o, acc, mask=rm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["M", "SB"])  # one compile for every row count
def _bgemm_q4k(
    x_ptr, qs_ptr, hdr_ptr, out_ptr, M, N, K, NB, SB,
    BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    rows, rm, cols, cm, split, s0, nb = _tile_start(M, N, NB, SB, BM, BN)
    lane = tl.arange(0, 8)
    steps = nb * 4
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, steps):  # pair j of super-block s: sub-blocks 2j and 2j + 1, 64 values
        s = s0 + i // 4
        j = i % 4
        d, dmin, h1, h2, h3 = _q4k_header(hdr_ptr, s, N, cols, cm)
        # the low and high nibbles of words 8j..8j+7 are sub-blocks 2j and 2j + 1
        wb = _split(_plane(qs_ptr, s * 32 + j * 8 + lane, cols, N, cm))
        for h in tl.static_range(2):
            sc, mn = _affine(h1, h2, h3, 2 * j + h)
            w = (d * sc)[None, :] * _codes((wb >> (4 * h)) & 15, 0.0) - (dmin * mn)[None, :]
            acc = _mma(acc, _x_tile(x_ptr, rows, rm, K, s * 256 + (2 * j + h) * 32), w, HALF)
    _store_split(out_ptr, acc, split, rows, rm, cols, cm, M, N)


@triton.jit(do_not_specialize=["M", "SB"])  # one compile for every row count
def _bgemm_q6k(
    x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, M, N, K, NB, SB,
    BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    rows, rm, cols, cm, split, s0, nb = _tile_start(M, N, NB, SB, BM, BN)
    lane = tl.arange(0, 8)
    steps = nb * 8
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, steps):  # quarter k of half hf of super-block s: 32 values
        s = s0 + i // 8
        hf = (i // 4) % 2
        k = i % 4
        d = tl.load(d_ptr + s * N + cols, mask=cm, other=0.0).to(tl.float32)
        code = _codes(_q6k_quarter_codes(ql_ptr, qh_ptr, s, i, lane, cols, N, cm), 32.0)
        # lane l's four codes share scale group hf * 8 + 2k + l // 4 (a signed byte)
        grp = hf * 8 + 2 * k + lane // 4
        scw = _plane(sc_ptr, s * 4 + grp // 4, cols, N, cm)
        sc = ((scw << (24 - 8 * (grp % 4))[:, None]) >> 24).to(tl.float32)
        sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (8, 4, BN)), (32, BN))
        w = d[None, :] * sc * code
        acc = _mma(acc, _x_tile(x_ptr, rows, rm, K, s * 256 + hf * 128 + k * 32), w, HALF)
    _store_split(out_ptr, acc, split, rows, rm, cols, cm, M, N)


@triton.jit(do_not_specialize=["M", "SB"])  # one compile for every row count
def _bgemm_q8_0(
    x_ptr, qs_ptr, d_ptr, out_ptr, M, N, K, NB, SB,
    BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    rows, rm, cols, cm, split, b0, steps = _tile_start(M, N, NB, SB, BM, BN)
    lane = tl.arange(0, 8)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, steps):  # block b: 32 values
        b = b0 + i
        d = tl.load(d_ptr + b * N + cols, mask=cm, other=0.0).to(tl.float32)
        wb = _split(_plane(qs_ptr, b * 8 + lane, cols, N, cm))
        code = _codes(wb ^ 0x80, 128.0)  # the byte as a signed code: its bits offset by 128
        acc = _mma(acc, _x_tile(x_ptr, rows, rm, K, b * 32), d[None, :] * code, HALF)
    _store_split(out_ptr, acc, split, rows, rm, cols, cm, M, N)
