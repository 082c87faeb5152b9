"""Loop-structure variants of the Q4_K grouped int8 GEMM (`kernels.moe.triton_grouped`), for
`bench_moe_prefill.py --variants`: one flat loop over 64-value steps (the software pipeliner sees
every load), weight bytes loaded as bytes or as int32 words split in registers. Same arguments
and results as `_grouped_q4k`."""

import triton
import triton.language as tl

from localllm.kernels.moe.triton_grouped import _byte_offsets, _rows, _store, _x8


@triton.jit
def _affine_rt(h1, h2, h3, sub):
    """`_q4k_affine` for a runtime sub-block index."""
    sh = (sub % 4) * 8
    a1 = (h1 >> sh) & 0xFF
    a2 = (h2 >> sh) & 0xFF
    a3 = (h3 >> sh) & 0xFF
    lo = sub < 4
    sc = tl.where(lo, a1 & 63, (a3 & 15) | ((a1 >> 6) << 4))
    mn = tl.where(lo, a2 & 63, ((a3 >> 4) & 15) | ((a2 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _f16(h, hi: tl.constexpr):
    if hi:
        h = h >> 16
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def grouped_q4k_flat(
    x8_ptr, xd_ptr, xs_ptr, sid_ptr, bexp_ptr, qs_ptr, hdr_ptr, out_ptr, N, K, ADIV,
    NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    e, pair, rm, arow = _rows(sid_ptr, bexp_ptr, ADIV, BM)
    if e >= 0:
        e64 = e.to(tl.int64)
        hdr_ptr += e64 * (NB * 4 * N)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < N
        if WORDS:  # qs_ptr: int32 words
            qs_ptr += e64 * (NB * 32 * N)
            lane = tl.arange(0, 8)
            b4 = tl.arange(0, 4)
        else:  # qs_ptr: bytes
            qs_ptr += e64 * (NB * 128 * N)
            roff = _byte_offsets(cols, N)
        K32 = K // 32
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(0, NB * 4):  # 64 values: 8 words, low nibbles then high
            s = i // 4
            jj = i % 4
            h0 = tl.load(hdr_ptr + (s * 4) * N + cols, mask=cm, other=0)
            h1 = tl.load(hdr_ptr + (s * 4 + 1) * N + cols, mask=cm, other=0)
            h2 = tl.load(hdr_ptr + (s * 4 + 2) * N + cols, mask=cm, other=0)
            h3 = tl.load(hdr_ptr + (s * 4 + 3) * N + cols, mask=cm, other=0)
            d, dmin = _f16(h0, False), _f16(h0, True)
            if WORDS:
                w = tl.load(qs_ptr + (i * 8 + lane)[:, None] * N + cols[None, :], mask=cm[None, :])
                wb = tl.reshape((w[:, None, :] >> (8 * b4)[None, :, None]) & 0xFF, (32, BN))
            else:
                wb = tl.load(qs_ptr + i * 8 * N * 4 + roff, mask=cm[None, :], other=0)
            for h in tl.static_range(2):
                sub = 2 * jj + h
                q = ((wb >> (4 * h)) & 15).to(tl.int8)
                a8 = _x8(x8_ptr, arow, rm, K, i * 64 + h * 32)
                isum = tl.dot(a8, q, out_dtype=tl.int32).to(tl.float32)
                sc, mn = _affine_rt(h1, h2, h3, sub)
                dx = tl.load(xd_ptr + arow * K32 + i * 2 + h, mask=rm, other=0.0)
                xs = tl.load(xs_ptr + arow * K32 + i * 2 + h, mask=rm, other=0.0)
                low = (dmin * mn)[None, :] * xs[:, None]
                acc += (d * sc)[None, :] * (dx[:, None] * isum) - low
        _store(out_ptr, acc, pair, rm, cols, cm, N)


def launch(xq, sp, p, adiv, words: bool, block_n: int, warps: int, stages: int):
    """`grouped.grouped_gemm` for a Q4_K weight through `grouped_q4k_flat`."""
    import torch

    out = torch.empty(sp.pairs, p.n, dtype=torch.float32, device=xq.words.device)
    qs = p.planes["qs"] if words else p.planes["qs"].view(torch.uint8)
    grid = (sp.experts.numel(), triton.cdiv(p.n, block_n))
    x8 = xq.words.view(torch.int8)
    args = (x8, xq.scale, xq.xsum, sp.rows, sp.experts, qs, p.planes["hdr"], out, p.n, p.k, adiv)
    geo = {"NB": p.k // 256, "BM": sp.bm, "BN": block_n, "WORDS": words}
    grouped_q4k_flat[grid](*args, **geo, num_warps=warps, num_stages=stages)
    return out
