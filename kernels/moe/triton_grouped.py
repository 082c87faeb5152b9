"""Triton grouped GEMMs over packed expert planes, on tensor cores (MoE prefill).

Program (m, n) multiplies BM activation rows that share one expert (rows sorted by expert and
padded per expert, `grouped.sort_pairs`) by BN weight rows of that expert. The weight is
dequantized tile by tile in registers to bf16 -- each value rounded once from the float32 value
gguf defines, as `dequantize_experts_t` writes it -- and never exists expanded in memory.

A tile's K positions come out in the packed words' order (word, then nibble or byte within it),
not the file's; `grouped.k_order` gives that order and the host permutes the activation columns
once per call to match (a dot product does not care about the order of its terms). Padding rows
carry pair -1: they load zeros and store nothing. Layouts: `repack.PackedBlocks`.
"""

import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import _plane, _q4k_affine, _q4k_header, _q6k_quarter


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
def _a_tile(a_ptr, arow, rm, K, k0, BK: tl.constexpr, F32: tl.constexpr):
    kk = k0 + tl.arange(0, BK)
    a = tl.load(a_ptr + arow[:, None] * K + kk[None, :], mask=rm[:, None], other=0.0)
    return _bf16(a, F32)


@triton.jit
def _bf16(x, F32: tl.constexpr):
    """x rounded to bf16 (to nearest, ties to even). F32: the triton interpreter, whose bf16
    conversion truncates and whose bf16 dot is wrong: the same values, kept as float32."""
    if F32:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _store(out_ptr, acc, pair, rm, cols, cm, N):
    o = out_ptr + pair.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(o, acc, mask=rm[:, None] & cm[None, :])


@triton.jit
def _grouped_q4k(
    a_ptr, sid_ptr, bexp_ptr, qs_ptr, hdr_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        qs_ptr += e64 * (NB * 32 * N)
        hdr_ptr += e64 * (NB * 4 * N)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < N
        lane = tl.arange(0, 8)
        t = tl.arange(0, 8)  # nibble t of a word: byte t // 2, high half when t is odd
        low = (t % 2 == 0)[:, None, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for s in range(0, NB):
            d, dmin, h1, h2, h3 = _q4k_header(hdr_ptr, s, N, cols, cm)
            for jj in tl.static_range(4):
                w = _plane(qs_ptr, s * 32 + jj * 8 + lane, cols, N, cm)  # [8 words, BN]
                q = ((w[None, :, :] >> (4 * t)[:, None, None]) & 15).to(tl.float32)
                sc0, mn0 = _q4k_affine(h1, h2, h3, 2 * jj)
                sc1, mn1 = _q4k_affine(h1, h2, h3, 2 * jj + 1)
                a = tl.where(low, (d * sc0)[None, None, :], (d * sc1)[None, None, :])
                c = tl.where(low, (dmin * mn0)[None, None, :], (dmin * mn1)[None, None, :])
                wt = _bf16(tl.reshape(a * q - c, (64, BN)), F32)  # row t * 8 + word
                acc = tl.dot(_a_tile(a_ptr, arow, rm, K, s * 256 + jj * 64, 64, F32), wt, acc)
        _store(out_ptr, acc, pair, rm, cols, cm, N)


@triton.jit
def _grouped_q6k(
    a_ptr, sid_ptr, bexp_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        ql_ptr += e64 * (NB * 32 * N)
        qh_ptr += e64 * (NB * 16 * N)
        sc_ptr += e64 * (NB * 4 * N)
        d_ptr += e64 * (NB * N)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < N
        lane = tl.arange(0, 8)
        b = tl.arange(0, 4)  # byte b of a word of 4 codes
        first = (lane < 4)[None, :, None]  # lanes 0-3 and 4-7 fall in two 16-value scale groups
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for s in range(0, NB):
            d = tl.load(d_ptr + s * N + cols, mask=cm, other=0.0).to(tl.float32)
            for hf in tl.static_range(2):
                qla = _plane(ql_ptr, s * 32 + hf * 16 + lane, cols, N, cm)
                qlb = _plane(ql_ptr, s * 32 + hf * 16 + 8 + lane, cols, N, cm)
                qh = _plane(qh_ptr, s * 16 + hf * 8 + lane, cols, N, cm)
                for k in tl.static_range(4):
                    grp = hf * 8 + 2 * k  # lanes 0-3; lanes 4-7 take grp + 1 (same word)
                    scw = tl.load(sc_ptr + (s * 4 + grp // 4) * N + cols, mask=cm, other=0)
                    s0 = ((scw << (24 - 8 * (grp % 4))) >> 24).to(tl.float32)
                    s1 = ((scw << (16 - 8 * (grp % 4))) >> 24).to(tl.float32)
                    sc = tl.where(first, (d * s0)[None, None, :], (d * s1)[None, None, :])
                    q = _q6k_quarter(qla, qlb, qh, k)  # [8 words, BN]
                    code = ((q[None, :, :] >> (8 * b)[:, None, None]) & 63).to(tl.float32) - 32.0
                    wt = _bf16(tl.reshape(sc * code, (32, BN)), F32)  # row b * 8 + word
                    k0 = s * 256 + hf * 128 + k * 32
                    acc = tl.dot(_a_tile(a_ptr, arow, rm, K, k0, 32, F32), wt, acc)
        _store(out_ptr, acc, pair, rm, cols, cm, N)


@triton.jit
def _grouped_q8_0(
    a_ptr, sid_ptr, bexp_ptr, qs_ptr, d_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        qs_ptr += e64 * (NB * 8 * N)
        d_ptr += e64 * (NB * N)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < N
        wd = tl.arange(0, 8 * BB)  # word wd: block wd // 8 of the step, word wd % 8 in it
        b = tl.arange(0, 4)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(0, NB // BB):
            w = _plane(qs_ptr, i * 8 * BB + wd, cols, N, cm)  # [8 * BB, BN]
            d = _plane(d_ptr, i * BB + wd // 8, cols, N, cm).to(tl.float32)
            code = ((w[None, :, :] << (24 - 8 * b)[:, None, None]) >> 24).to(tl.float32)
            wt = _bf16(tl.reshape(d[None, :, :] * code, (32 * BB, BN)), F32)  # row b * 8BB + word
            acc = tl.dot(_a_tile(a_ptr, arow, rm, K, i * 32 * BB, 32 * BB, F32), wt, acc)
        _store(out_ptr, acc, pair, rm, cols, cm, N)
