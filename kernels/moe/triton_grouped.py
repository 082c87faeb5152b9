"""Triton grouped GEMMs over packed expert blocks, on int8 tensor cores (MoE prefill).

Program (m, n) multiplies BM activation rows that share one expert (rows sorted by expert and
padded per expert, `grouped.sort_pairs`) by BN weight rows of that expert. As llama.cpp's MMQ
does, the activations come quantized to int8 per 32 values (`quantize_x8`, the decode GEMVs'
format) and every 32-value sub-block is one int8 tensor-core product of the raw weight codes:
no weight value is ever converted to float, and floats appear once per sub-block (scales, and
the Q4_K minimum through the activations' code sums). Weight words are read from the packed
planes and split into bytes in registers: byte b of word w is the code at K offset 4 w + b, the
file's order, so the activations need no permutation. One flat loop per kernel over 32- or
64-value steps lets triton's software pipeliner prefetch every load (nested loops measured 1.9x
slower at 512 tokens, tests/perf/results/gpu-kernels.md).
Padding rows carry pair -1: they load zeros and store nothing. Layouts: `repack.PackedBlocks`;
the float formulas are those of `triton_dp4a`'s GEMVs, so a pair's value matches decode's
within float rounding.
"""

import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import _plane, _q4k_header, _q8_words
from localllm.kernels.quant.triton_unpack import _affine, _q6k_quarter_codes, _split


@triton.jit
def _rows(sid_ptr, bexp_ptr, ADIV, BM: tl.constexpr):
    """This program's expert (-1: past the last padded block), output rows (pairs, -1 for
    padding) and activation rows."""
    pm = tl.program_id(0)
    e = tl.load(bexp_ptr + pm)
    pair = tl.load(sid_ptr + pm * BM + tl.arange(0, BM))
    rm = pair >= 0
    return e, pair, rm, tl.where(rm, pair // ADIV, 0).to(tl.int64)


@triton.jit
def _cols(N, BN: tl.constexpr):
    """This program's weight rows (output columns) and which of them exist."""
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    return cols, cols < N


@triton.jit
def _x8(x8_ptr, arow, rm, K, k0):
    """Activation codes [BM, 32] at K offset k0 (int8)."""
    kk = k0 + tl.arange(0, 32)
    return tl.load(x8_ptr + arow[:, None] * K + kk[None, :], mask=rm[:, None], other=0)


@triton.jit
def _store(out_ptr, acc, pair, rm, cols, cm, N):
    o = out_ptr + pair.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(o, acc, mask=rm[:, None] & cm[None, :])


@triton.jit
def _grouped_q4k(
    x8_ptr, xd_ptr, xs_ptr, sid_ptr, bexp_ptr, qs_ptr, hdr_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        qs_ptr += e64 * (NB * 32 * N)
        hdr_ptr += e64 * (NB * 4 * N)
        cols, cm = _cols(N, BN)
        lane = tl.arange(0, 8)
        K32 = K // 32
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        # one flat loop (the software pipeliner sees every load): 64 values a step, 8 words
        for i in range(0, NB * 4):
            s = i // 4
            d, dmin, h1, h2, h3 = _q4k_header(hdr_ptr, s, N, cols, cm)
            wb = _split(_plane(qs_ptr, i * 8 + lane, cols, N, cm))
            for h in tl.static_range(2):  # low nibbles: sub-block 2 (i % 4), high: the next
                sub = 2 * (i % 4) + h
                q = ((wb >> (4 * h)) & 15).to(tl.int8)
                isum = tl.dot(_x8(x8_ptr, arow, rm, K, i * 64 + h * 32), q, out_dtype=tl.int32)
                sc, mn = _affine(h1, h2, h3, sub)
                dx = tl.load(xd_ptr + arow * K32 + i * 2 + h, mask=rm, other=0.0)
                xs = tl.load(xs_ptr + arow * K32 + i * 2 + h, mask=rm, other=0.0)
                low = (dmin * mn)[None, :] * xs[:, None]  # the sub-block's minimum, summed
                acc += (d * sc)[None, :] * (dx[:, None] * isum.to(tl.float32)) - low
        _store(out_ptr, acc, pair, rm, cols, cm, N)


@triton.jit
def _grouped_q6k(
    x8_ptr, xd_ptr, sid_ptr, bexp_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        ql_ptr += e64 * (NB * 32 * N)
        qh_ptr += e64 * (NB * 16 * N)
        sc_ptr += e64 * (NB * 4 * N)
        d_ptr += e64 * (NB * N)
        cols, cm = _cols(N, BN)
        lane = tl.arange(0, 8)
        first = (tl.arange(0, 32) < 16)[None, :]  # a quarter's two 16-value scale groups
        K32 = K // 32
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(0, NB * 8):  # quarter k of half hf of super-block s: 32 values
            s = i // 8
            hf = (i // 4) % 2
            k = i % 4
            d = tl.load(d_ptr + s * N + cols, mask=cm, other=0.0).to(tl.float32)
            q = (_q6k_quarter_codes(ql_ptr, qh_ptr, s, i, lane, cols, N, cm) - 32).to(tl.int8)
            a8 = _x8(x8_ptr, arow, rm, K, i * 32)
            i0 = tl.dot(tl.where(first, a8, 0), q, out_dtype=tl.int32).to(tl.float32)
            i1 = tl.dot(tl.where(first, 0, a8), q, out_dtype=tl.int32).to(tl.float32)
            grp = hf * 8 + 2 * k  # the first group's scale; the second is the next byte
            scw = tl.load(sc_ptr + (s * 4 + grp // 4) * N + cols, mask=cm, other=0)
            s0 = ((scw << (24 - 8 * (grp % 4))) >> 24).to(tl.float32)
            s1 = ((scw << (16 - 8 * (grp % 4))) >> 24).to(tl.float32)
            dx = tl.load(xd_ptr + arow * K32 + i, mask=rm, other=0.0)[:, None]
            acc += (d * s0)[None, :] * (i0 * dx) + (d * s1)[None, :] * (i1 * dx)
        _store(out_ptr, acc, pair, rm, cols, cm, N)


@triton.jit
def _grouped_q8_0(
    x8_ptr, xd_ptr, sid_ptr, bexp_ptr, qs_ptr, d_ptr, qh_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, Q5: tl.constexpr,
):  # fmt: skip
    # Q5: Q5_0 planes, whose words `_q8_words` builds (Q8_0's codes, the same sums)
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        qs_ptr += e64 * (NB * (4 if Q5 else 8) * N)
        d_ptr += e64 * (NB * N)
        if Q5:
            qh_ptr += e64 * (NB * N)
        cols, cm = _cols(N, BN)
        lane = tl.arange(0, 8)
        K32 = K // 32
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for b in range(0, NB):
            q = _split(_q8_words(qs_ptr, qh_ptr, b, lane, cols, N, cm, Q5)).to(tl.int8)  # signed
            isum = tl.dot(_x8(x8_ptr, arow, rm, K, b * 32), q, out_dtype=tl.int32)
            d = tl.load(d_ptr + b * N + cols, mask=cm, other=0.0).to(tl.float32)
            dx = tl.load(xd_ptr + arow * K32 + b, mask=rm, other=0.0)
            acc += d[None, :] * (dx[:, None] * isum.to(tl.float32))
        _store(out_ptr, acc, pair, rm, cols, cm, N)
