"""Triton dequantization of packed (column-major) Q4_K, Q6_K and Q8_0 (or Q5_0) blocks to a bf16
W^T.

Prefill multiplies many rows at once on tensor cores: the packed weight is expanded once per call
into W^T [K, N] bf16 (each value rounded once from the float32 value gguf defines) and multiplied
by cuBLAS. Writing W^T keeps the stores coalesced: a tile is BN neighbouring weight rows, which are
neighbouring columns of W^T. Grid axis 2 walks stacked experts (`pack_expert_blocks`), one W^T each.
Layouts: `repack.PackedBlocks`; references: `dequant`.
"""

import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import (
    _plane,
    _q4k_affine,
    _q4k_header,
    _q6k_quarter,
    _q8_words,
)


@triton.jit
def _deq_q4k_packed(qs_ptr, hdr_ptr, out_ptr, N, NB, E0, BN: tl.constexpr):
    j = tl.program_id(2)  # stacked experts: expert E0 + j into out[j]
    e = (E0 + j).to(tl.int64)
    qs_ptr += e * (NB * 32 * N)
    hdr_ptr += e * (NB * 4 * N)
    out_ptr += j.to(tl.int64) * (NB * 256 * N)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < N
    s = tl.program_id(1)
    lane = tl.arange(0, 8)
    d, dmin, h1, h2, h3 = _q4k_header(hdr_ptr, s, N, cols, cm)
    for jj in tl.static_range(4):
        w = _plane(qs_ptr, s * 32 + jj * 8 + lane, cols, N, cm)
        for h in tl.static_range(2):
            sub = 2 * jj + h
            sc, mn = _q4k_affine(h1, h2, h3, sub)
            a, c = (d * sc)[None, :], (dmin * mn)[None, :]
            for b in tl.static_range(4):
                q = ((w >> (8 * b + 4 * h)) & 15).to(tl.float32)
                krow = s * 256 + sub * 32 + 4 * lane + b
                o = out_ptr + krow.to(tl.int64)[:, None] * N + cols[None, :]
                tl.store(o, (a * q - c).to(tl.bfloat16), mask=cm[None, :])


@triton.jit
def _deq_q6k_packed(ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, N, NB, E0, BN: tl.constexpr):
    j = tl.program_id(2)
    e = (E0 + j).to(tl.int64)
    ql_ptr += e * (NB * 32 * N)
    qh_ptr += e * (NB * 16 * N)
    sc_ptr += e * (NB * 4 * N)
    d_ptr += e * (NB * N)
    out_ptr += j.to(tl.int64) * (NB * 256 * N)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < N
    s = tl.program_id(1)
    lane = tl.arange(0, 8)
    d = tl.load(d_ptr + s * N + cols, mask=cm, other=0.0).to(tl.float32)
    for hf in tl.static_range(2):
        qla = _plane(ql_ptr, s * 32 + hf * 16 + lane, cols, N, cm)
        qlb = _plane(ql_ptr, s * 32 + hf * 16 + 8 + lane, cols, N, cm)
        qh = _plane(qh_ptr, s * 16 + hf * 8 + lane, cols, N, cm)
        for k in tl.static_range(4):
            q = _q6k_quarter(qla, qlb, qh, k)
            # scale group of lane l: hf * 8 + 2k + l // 4 (two groups per [8, BN] tile)
            grp = hf * 8 + 2 * k + lane // 4
            scw = _plane(sc_ptr, s * 4 + grp // 4, cols, N, cm)
            sc = ((scw << (24 - 8 * (grp % 4))[:, None]) >> 24).to(tl.float32)
            for b in tl.static_range(4):
                code = ((q >> (8 * b)) & 63).to(tl.float32) - 32.0
                krow = s * 256 + hf * 128 + 32 * k + 4 * lane + b
                o = out_ptr + krow.to(tl.int64)[:, None] * N + cols[None, :]
                tl.store(o, (d[None, :] * sc * code).to(tl.bfloat16), mask=cm[None, :])


@triton.jit
def _deq_q8_0_packed(qs_ptr, d_ptr, qh_ptr, out_ptr, N, NB, E0, BN: tl.constexpr,
                     BB: tl.constexpr, Q5: tl.constexpr):  # fmt: skip
    # Q5: Q5_0 planes (`triton_dp4a._q8_words` builds Q8_0's words from them)
    j = tl.program_id(2)
    e = (E0 + j).to(tl.int64)
    qs_ptr += e * (NB * (4 if Q5 else 8) * N)
    d_ptr += e * (NB * N)
    if Q5:
        qh_ptr += e * (NB * N)
    out_ptr += j.to(tl.int64) * (NB * 32 * N)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < N
    lane = tl.arange(0, 8)
    for i in tl.static_range(BB):
        blk = tl.program_id(1) * BB + i
        w = _q8_words(qs_ptr, qh_ptr, blk, lane, cols, N, cm, Q5)
        d = tl.load(d_ptr + blk * N + cols, mask=cm, other=0.0).to(tl.float32)
        for b in tl.static_range(4):
            code = ((w << (24 - 8 * b)) >> 24).to(tl.float32)
            krow = blk * 32 + 4 * lane + b
            o = out_ptr + krow.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(o, (d[None, :] * code).to(tl.bfloat16), mask=cm[None, :])


@triton.jit
def _split(w):
    """Words [8, BN] -> their bytes [32, BN] as int32 (row r: byte r % 4 of word r // 4, the
    code at K offset r)."""
    b4 = tl.arange(0, 4)
    return tl.reshape((w[:, None, :] >> (8 * b4)[None, :, None]) & 0xFF, (32, w.shape[1]))


@triton.jit
def _affine(h1, h2, h3, sub):
    """`triton_dp4a._q4k_affine` for a sub-block index known only at run time (a flat loop's);
    the decode GEMVs keep the compile-time form, whose branch drops the unused header word."""
    sh = (sub % 4) * 8
    a1 = (h1 >> sh) & 0xFF
    a2 = (h2 >> sh) & 0xFF
    a3 = (h3 >> sh) & 0xFF
    lo = sub < 4
    sc = tl.where(lo, a1 & 63, (a3 & 15) | ((a1 >> 6) << 4))
    mn = tl.where(lo, a2 & 63, ((a3 >> 4) & 15) | ((a2 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q6k_quarter_codes(ql_ptr, qh_ptr, s, i, lane, cols, N, cm):
    """Codes 0..63 [32, BN] of step i (quarter i % 4 of half (i // 4) % 2) of super-block s, for
    a flat loop whose quarter is known only at run time (`_q6k_quarter`'s compile-time form)."""
    hf = (i // 4) % 2
    k = i % 4
    lo = _plane(ql_ptr, s * 32 + hf * 16 + (k % 2) * 8 + lane, cols, N, cm)
    hi = _plane(qh_ptr, s * 16 + hf * 8 + lane, cols, N, cm)
    return _split(((lo >> (4 * (k // 2))) & 0x0F0F0F0F) | (((hi >> (2 * k)) & 0x03030303) << 4))
