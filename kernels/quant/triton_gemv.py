"""Triton kernels over raw GGUF blocks on CUDA: fused dequant-GEMV (decode) and dequant-to-bf16
tiles (prefill, then a bf16 tensor-core GEMM). Q8_0, Q4_0, IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q5_K,
Q6_K.

Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests): CPU installs never
import triton. Each GEMV program owns BLOCK_N weight rows of one activation row and walks K,
reading every weight byte once; activations are float32, sums are float32. Programs of the same
row tile run next to each other, so for M > 1 the weight bytes come from L2 after the first read.
The torch references are `localllm.kernels.quant.dequant` (the tests compare against them);
the host side (launch geometry, `TritonLinear`) is `triton_linear`.
"""

import triton
import triton.language as tl


@triton.jit
def _f16_bits(lo, hi):
    """Two little-endian bytes -> their uint16 value as int32."""
    return (lo.to(tl.int32) & 0xFF) | ((hi.to(tl.int32) & 0xFF) << 8)


@triton.jit
def _f16_at(lo, hi):
    """Two little-endian bytes (any int type, values 0..255) -> float32 of the fp16 they encode."""
    return _f16_bits(lo, hi).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# -- Q8_0: 34-byte blocks of 32 values: fp16 d, then 32 int8 codes; w = d * q ----------------


@triton.jit
def _q8_0_tile(w_ptr, rows, rmask, row_bytes, blk, bmask):
    """Dequantized [BN, BB, 32] float32 values of blocks `blk` of `rows`."""
    j = tl.arange(0, 32)
    base = rows.to(tl.int64)[:, None] * row_bytes + blk[None, :] * 34  # [BN, BB]
    m2 = rmask[:, None] & bmask[None, :]
    q = tl.load(w_ptr + base[:, :, None] + 2 + j[None, None, :], mask=m2[:, :, None], other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    d = _f16_at(
        tl.load(w_ptr + base, mask=m2, other=0), tl.load(w_ptr + base + 1, mask=m2, other=0)
    )
    return q * d[:, :, None]


@triton.jit
def _gemv_q8_0(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    nb: tl.constexpr,
    row_bytes,
    BLOCK_N: tl.constexpr,
    BB: tl.constexpr,
):
    pid = tl.program_id(0)
    m, nt = pid % M, pid // M
    rows = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b0 in range(0, nb, BB):
        blk = b0 + tl.arange(0, BB)
        bmask = blk < nb
        w = _q8_0_tile(w_ptr, rows, rmask, row_bytes, blk, bmask)
        xo = m * K + blk[:, None] * 32 + tl.arange(0, 32)[None, :]
        xv = tl.load(x_ptr + xo, mask=bmask[:, None], other=0.0)
        acc += tl.sum(tl.sum(w * xv[None, :, :], axis=2), axis=1)
    tl.store(y_ptr + m * N + rows, acc, mask=rmask)


@triton.jit
def _deq_q8_0(
    w_ptr, out_ptr, N, K, nb: tl.constexpr, row_bytes, BLOCK_N: tl.constexpr, BB: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    blk = tl.program_id(1) * BB + tl.arange(0, BB)
    bmask = blk < nb
    w = _q8_0_tile(w_ptr, rows, rmask, row_bytes, blk, bmask)
    o = rows.to(tl.int64)[:, None, None] * K + blk[None, :, None] * 32 + tl.arange(0, 32)
    m3 = (rmask[:, None] & bmask[None, :])[:, :, None]
    tl.store(out_ptr + o, w.to(tl.bfloat16), mask=m3)


# -- 4-bit codes in 32-value groups of 16 bytes (byte j: value j in the low nibble, j + 16 in the
# high one), KIND selects the scale and code map:
#   0 Q4_0: 18-byte blocks, fp16 d, w = d * (q - 8)
#   1 IQ4_NL: 18-byte blocks, fp16 d, w = d * lut[q]
#   2 MXFP4: 17-byte blocks, e8m0 exponent byte, w = 2^(e-128) * lut[q] (lut: doubled E2M1)
#   3 IQ4_XS: 136-byte super-blocks of 8 groups: fp16 d, 2-bit and 4-bit halves of 6-bit group
#     scales, then 8 x 16 code bytes; w = d * (scale - 32) * lut[q]
# `blk` counts groups along the row.


@triton.jit
def _nib32_tile(w_ptr, lut_ptr, rows, rmask, row_bytes, blk, bmask, KIND: tl.constexpr):
    """Values j and j + 16 of groups `blk` of `rows`, each [BN, BB, 16] float32."""
    j = tl.arange(0, 16)
    m2 = rmask[:, None] & bmask[None, :]
    row0 = rows.to(tl.int64)[:, None] * row_bytes
    if KIND == 3:
        base = row0 + (blk // 8)[None, :] * 136
        ib = (blk % 8)[None, :]
        qoff = base + 8 + 16 * ib
    else:
        base = row0 + blk[None, :] * (17 if KIND == 2 else 18)
        qoff = base + (1 if KIND == 2 else 2)
    qs = tl.load(w_ptr + qoff[:, :, None] + j[None, None, :], mask=m2[:, :, None], other=0)
    qs = qs.to(tl.int32)
    lo, hi = qs & 15, qs >> 4
    if KIND == 2:
        e = tl.load(w_ptr + base, mask=m2, other=0).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    else:
        d = _f16_at(tl.load(w_ptr + base, mask=m2, other=0), tl.load(w_ptr + base + 1, mask=m2))
    if KIND == 3:
        sl = tl.load(w_ptr + base + 4 + ib // 2, mask=m2, other=0).to(tl.int32)
        sh = _f16_bits(tl.load(w_ptr + base + 2, mask=m2), tl.load(w_ptr + base + 3, mask=m2))
        sc = ((sl >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
        d = d * (sc - 32).to(tl.float32)
    d = d[:, :, None]
    if KIND == 0:
        return (lo - 8).to(tl.float32) * d, (hi - 8).to(tl.float32) * d
    return tl.load(lut_ptr + lo) * d, tl.load(lut_ptr + hi) * d


@triton.jit
def _gemv_nib32(
    x_ptr, w_ptr, lut_ptr, y_ptr, M, N, K, nb: tl.constexpr, row_bytes, BLOCK_N: tl.constexpr,
    BB: tl.constexpr, KIND: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m, nt = pid % M, pid // M
    rows = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b0 in range(0, nb, BB):
        blk = b0 + tl.arange(0, BB)
        bmask = blk < nb
        lo, hi = _nib32_tile(w_ptr, lut_ptr, rows, rmask, row_bytes, blk, bmask, KIND)
        xo = m * K + blk[:, None] * 32 + tl.arange(0, 16)[None, :]
        xlo = tl.load(x_ptr + xo, mask=bmask[:, None], other=0.0)
        xhi = tl.load(x_ptr + xo + 16, mask=bmask[:, None], other=0.0)
        acc += tl.sum(tl.sum(lo * xlo[None, :, :] + hi * xhi[None, :, :], axis=2), axis=1)
    tl.store(y_ptr + m * N + rows, acc, mask=rmask)


@triton.jit
def _deq_nib32(
    w_ptr, lut_ptr, out_ptr, N, K, nb: tl.constexpr, row_bytes, BLOCK_N: tl.constexpr,
    BB: tl.constexpr, KIND: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    blk = tl.program_id(1) * BB + tl.arange(0, BB)
    bmask = blk < nb
    lo, hi = _nib32_tile(w_ptr, lut_ptr, rows, rmask, row_bytes, blk, bmask, KIND)
    o = rows.to(tl.int64)[:, None, None] * K + blk[None, :, None] * 32 + tl.arange(0, 16)
    m3 = (rmask[:, None] & bmask[None, :])[:, :, None]
    tl.store(out_ptr + o, lo.to(tl.bfloat16), mask=m3)
    tl.store(out_ptr + o + 16, hi.to(tl.bfloat16), mask=m3)


# -- Q4_K: 144-byte super-blocks of 256 (read as 36 int32 words): fp16 d, fp16 dmin, 12 bytes of
# 6-bit scales/mins for 8 sub-blocks of 32, then 32 words of nibbles; w = d*sc*q - dmin*m.
# Nibble word w (0..31) of a super-block: group jj = w // 8, lane = w % 8; its byte b holds
# value (2jj + h)*32 + 4*lane + b in nibble h. Tiles are 2-D [rows, S*32 words] (S super-blocks
# side by side): every load is wide and independent, products accumulate elementwise and are
# reduced once at the end.


@triton.jit
def _q4_k_words(w32_ptr, rows, rmask, row_words, s0, nb, S: tl.constexpr, FIVE: tl.constexpr):
    """Nibble words [BN, S*32], their super-block index and word-in-block index [S*32], the
    per-word header values d, dmin and scale words [BN, S*32] (broadcast loads, L1 hits), and for
    Q5_K (FIVE) the high-bit word of each nibble word's bytes (else the nibble words again)."""
    t = tl.arange(0, S * 32)
    sb = s0 + t // 32
    w = t % 32
    base = rows.to(tl.int64)[:, None] * row_words + sb[None, :] * (44 if FIVE else 36)
    m2 = rmask[:, None] & (sb < nb)[None, :]
    qw = tl.load(w32_ptr + base + (12 if FIVE else 4) + w[None, :], mask=m2, other=0)
    qh = qw
    if FIVE:  # Q5_K: qh byte l holds bit (2jj + h) of value l of each sub-block pair
        qh = tl.load(w32_ptr + base + 4 + (w % 8)[None, :], mask=m2, other=0)
    hdr = tl.load(w32_ptr + base, mask=m2, other=0)
    d = _f16_at(hdr & 0xFF, (hdr >> 8) & 0xFF)
    dmin = _f16_at((hdr >> 16) & 0xFF, (hdr >> 24) & 0xFF)
    w1 = tl.load(w32_ptr + base + 1, mask=m2, other=0)
    w2 = tl.load(w32_ptr + base + 2, mask=m2, other=0)
    w3 = tl.load(w32_ptr + base + 3, mask=m2, other=0)
    return qw, qh, sb, w, d, dmin, w1, w2, w3


@triton.jit
def _k_code(qw, qh, w, b: tl.constexpr, h: tl.constexpr, FIVE: tl.constexpr):
    """Codes of byte b, nibble h of each word as float32 (plus the Q5_K high bit)."""
    q = (qw >> (8 * b + 4 * h)) & 15
    if FIVE:
        q = q | (((qh >> (8 * b + 2 * (w // 8) + h)[None, :]) & 1) << 4)
    return q.to(tl.float32)


@triton.jit
def _q4_k_affine(d, dmin, w1, w2, w3, w, h: tl.constexpr):
    """a = d*sc and c = dmin*m of nibble half h for each word [BN, S*32]: value = a*q - c."""
    sub = 2 * (w // 8) + h  # [S*32]
    sh = ((sub % 4) * 8)[None, :]
    a1 = (w1 >> sh) & 0xFF
    a2 = (w2 >> sh) & 0xFF
    a3 = (w3 >> sh) & 0xFF
    lo = (sub < 4)[None, :]
    sc = tl.where(lo, a1 & 63, (a3 & 15) | ((a1 >> 6) << 4))
    mn = tl.where(lo, a2 & 63, (a3 >> 4) | ((a2 >> 6) << 4))
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def _gemv_q4_k(
    x_ptr, w32_ptr, y_ptr, M, N, K, nb: tl.constexpr, row_words, BLOCK_N: tl.constexpr,
    S: tl.constexpr, FIVE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m, nt = pid % M, pid // M
    rows = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, S * 32], dtype=tl.float32)
    for s0 in range(0, nb, S):
        qw, qh, sb, w, d, dmin, w1, w2, w3 = _q4_k_words(
            w32_ptr, rows, rmask, row_words, s0, nb, S, FIVE
        )
        smask = sb < nb
        for h in tl.static_range(2):
            a, c = _q4_k_affine(d, dmin, w1, w2, w3, w, h)
            col = m * K + sb * 256 + (2 * (w // 8) + h) * 32 + 4 * (w % 8)
            for b in tl.static_range(4):
                q = _k_code(qw, qh, w, b, h, FIVE)
                xv = tl.load(x_ptr + col + b, mask=smask, other=0.0)
                acc += (a * q - c) * xv[None, :]
    tl.store(y_ptr + m * N + rows, tl.sum(acc, axis=1), mask=rmask)


@triton.jit
def _deq_q4_k(
    w32_ptr, out_ptr, N, K, row_words, BLOCK_N: tl.constexpr, S: tl.constexpr, FIVE: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    s0 = tl.program_id(1) * S
    qw, qh, _, w, d, dmin, w1, w2, w3 = _q4_k_words(
        w32_ptr, rows, rmask, row_words, s0, s0 + S, S, FIVE
    )
    for h in tl.static_range(2):
        a, c = _q4_k_affine(d, dmin, w1, w2, w3, w, h)
        v0 = a * _k_code(qw, qh, w, 0, h, FIVE) - c
        v1 = a * _k_code(qw, qh, w, 1, h, FIVE) - c
        v2 = a * _k_code(qw, qh, w, 2, h, FIVE) - c
        v3 = a * _k_code(qw, qh, w, 3, h, FIVE) - c
        # bytes b = 0..3 of a word are 4 consecutive values: interleave them for one wide store
        v = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, S*32, 2, 2], [.., k, i] = v(2k+i)
        v = tl.reshape(v, (BLOCK_N, S * 128))
        e = tl.arange(0, S * 128)
        t = e // 4
        col = (s0 + t // 32) * 256 + (2 * ((t % 32) // 8) + h) * 32 + 4 * (t % 8) + e % 4
        o = rows.to(tl.int64)[:, None] * K + col[None, :]
        tl.store(out_ptr + o, v.to(tl.bfloat16), mask=rmask[:, None])


# -- Q6_K: 210-byte super-blocks: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8
# scales (one per 16 values), fp16 d; w = d * scale * (q - 32). Half hf, byte l of each quarter.


@triton.jit
def _q6_k_parts(w_ptr, base, rmask):
    """The two low-nibble byte sets, the high-bit bytes [BN, 2, 32] and d [BN] of a super-block."""
    hf = tl.arange(0, 2)
    l32 = tl.arange(0, 32)
    m3 = rmask[:, None, None]
    off = base[:, None, None] + hf[None, :, None] * 64 + l32[None, None, :]
    ql_a = tl.load(w_ptr + off, mask=m3, other=0).to(tl.int32)
    ql_b = tl.load(w_ptr + off + 32, mask=m3, other=0).to(tl.int32)
    qh = tl.load(w_ptr + off + 128 - hf[None, :, None] * 32, mask=m3, other=0).to(tl.int32)
    d = _f16_at(
        tl.load(w_ptr + base + 208, mask=rmask, other=0),
        tl.load(w_ptr + base + 209, mask=rmask, other=0),
    )
    return ql_a, ql_b, qh, d


@triton.jit
def _q6_k_codes(ql_a, ql_b, qh, k: tl.constexpr):
    """Signed codes of quarter k (values 128*hf + 32*k + l) as float32 [BN, 2, 32]."""
    lo = ql_a if k % 2 == 0 else ql_b
    lo = (lo >> (4 * (k // 2))) & 15
    return (lo | (((qh >> (2 * k)) & 3) << 4)).to(tl.float32) - 32.0


@triton.jit
def _q6_k_scales(w_ptr, base, rmask, k: tl.constexpr):
    """int8 scales of quarter k as float32 [BN, 2, 2] (half, first/second 16 values)."""
    hf = tl.arange(0, 2)
    i = tl.arange(0, 2)
    off = base[:, None, None] + 192 + 8 * hf[None, :, None] + 2 * k + i[None, None, :]
    sc = tl.load(w_ptr + off, mask=rmask[:, None, None], other=0)
    return sc.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_q6_k(x_ptr, w_ptr, y_ptr, M, N, K, nb: tl.constexpr, row_bytes, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    m, nt = pid % M, pid // M
    rows = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    hf = tl.arange(0, 2)
    l32 = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(0, nb):
        base = rows.to(tl.int64) * row_bytes + s * 210
        ql_a, ql_b, qh, d = _q6_k_parts(w_ptr, base, rmask)
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(4):
            q = _q6_k_codes(ql_a, ql_b, qh, k)
            xv = tl.load(x_ptr + m * K + s * 256 + hf[:, None] * 128 + 32 * k + l32[None, :])
            prod = tl.reshape(q * xv[None, :, :], (BLOCK_N, 2, 2, 16))
            dot = tl.sum(prod, axis=3)  # [BN, 2, 2]
            sc = _q6_k_scales(w_ptr, base, rmask, k)
            part += tl.sum(tl.sum(sc * dot, axis=2), axis=1)
        acc += d * part
    tl.store(y_ptr + m * N + rows, acc, mask=rmask)


@triton.jit
def _deq_q6_k(w_ptr, out_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    s = tl.program_id(1)
    hf = tl.arange(0, 2)
    l32 = tl.arange(0, 32)
    base = rows.to(tl.int64) * row_bytes + s * 210
    ql_a, ql_b, qh, d = _q6_k_parts(w_ptr, base, rmask)
    for k in tl.static_range(4):
        q = tl.reshape(_q6_k_codes(ql_a, ql_b, qh, k), (BLOCK_N, 2, 2, 16))
        sc = _q6_k_scales(w_ptr, base, rmask, k)
        w = tl.reshape(q * (sc * d[:, None, None])[:, :, :, None], (BLOCK_N, 2, 32))
        col = s * 256 + hf[:, None] * 128 + 32 * k + l32[None, :]
        o = rows.to(tl.int64)[:, None, None] * K + col[None, :, :]
        tl.store(out_ptr + o, w.to(tl.bfloat16), mask=rmask[:, None, None])
