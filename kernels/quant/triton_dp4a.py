"""Triton dp4a kernels over packed (column-major) Q4_K, Q6_K and Q8_0 (or Q5_0) blocks on CUDA.

Decode GEMVs are bound by weight bytes, and converting every code to float costs more than the
bytes allow (int->float runs at a quarter of the FMA rate). So, as llama.cpp's mmvq does, the
activation row is quantized to int8 per 32 values (scale dx, code sums per 16) and every 4 weight
codes meet 4 activation codes in one integer dot product (dp4a); floats appear once per 16 or 32
values. Layouts are `repack.PackedBlocks`: a [words, BN] tile is BN neighbouring weight rows, one
per thread, so loads coalesce and sums stay in registers. Programs split K in chunks of blocks
(grid axis 1) and write partial sums that the host adds. `ASM` is false only under the triton
interpreter (CPU tests), which runs the same integer math without the PTX instruction. The torch
reference is `q8x_reference.gemv_q8x_reference`.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from localllm.kernels.pdl import gdc_begin, gdc_wait, prefetch_plane
from localllm.kernels.quant.triton_lora_tail import (
    lora_program,
    lora_release,
    lora_shrink_item,
    lora_tail,
    lora_wait,
)


@triton.jit
def _dp4a(a, b, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """Sum of the 4 byte products of a and b (b signed; a signed or unsigned), int32."""
    a, b = tl.broadcast(a, b)
    if ASM:
        c = tl.zeros(a.shape, dtype=tl.int32)
        if SIGNED_A:
            r = tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], tl.int32, True, 1
            )
        else:
            r = tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], tl.int32, True, 1
            )
    else:
        r = tl.zeros(a.shape, dtype=tl.int32)
        for i in tl.static_range(4):
            if SIGNED_A:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 255
            r += ai * ((b << (24 - 8 * i)) >> 24)
    return r


@triton.jit
def quant_groups(v, g, gm, q_ptr, d_ptr, s16_ptr, xsum_ptr, G: tl.constexpr, RN: tl.constexpr):
    """Quantize groups `g` [G] of 32 values v [G, 32] of one row (pointers at the row's start)
    to int8 codes (4 per int32 word), scale and code sums per 32 (dx, dx * sum) and integer
    code sums per 16; `gm` masks groups past the row. Fused kernels call it on their output.
    RN (CUDA): round the product before adding 0.5, as the reference does; the compiler would
    fuse them into one fma and round differently at near-ties. The interpreter never fuses."""
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax), 0.0)
    if RN:
        t = libdevice.mul_rn(v, inv[:, None])
    else:
        t = v * inv[:, None]
    q = tl.floor(t + 0.5).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    qb = tl.reshape(q & 255, (G, 8, 4))
    sh = (tl.arange(0, 4) * 8)[None, None, :]
    words = tl.sum(qb << sh, axis=2)  # disjoint bytes: the sum is their bitwise or
    w8 = tl.arange(0, 8)
    tl.store(q_ptr + g[:, None] * 8 + w8[None, :], words, mask=gm[:, None])
    s16 = tl.sum(tl.reshape(q, (G, 2, 16)), axis=2)
    i2 = tl.arange(0, 2)
    tl.store(s16_ptr + g[:, None] * 2 + i2[None, :], s16, mask=gm[:, None])
    dx = amax / 127.0
    tl.store(d_ptr + g, dx, mask=gm)
    tl.store(xsum_ptr + g, dx * tl.sum(q, axis=1).to(tl.float32), mask=gm)


@triton.jit
def _quant_x8(
    x_ptr, q_ptr, d_ptr, s16_ptr, xsum_ptr, K, G: tl.constexpr, RN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """x [M, K] float32 -> int8 codes (4 per int32 word), scale and code sums per 32 values
    (dx, dx * sum) and integer code sums per 16. Program (m, chunk) handles G groups of 32."""
    gdc_begin(PDL)
    gdc_wait(PDL)
    m = tl.program_id(0)
    g = tl.program_id(1) * G + tl.arange(0, G)
    gm = g < K // 32
    j = tl.arange(0, 32)
    v = tl.load(x_ptr + m * K + g[:, None] * 32 + j[None, :], mask=gm[:, None], other=0.0)
    k32 = m * (K // 32)
    quant_groups(
        v, g, gm, q_ptr + m * (K // 4), d_ptr + k32, s16_ptr + m * (K // 16), xsum_ptr + k32, G, RN
    )


@triton.jit
def _f16_lo(h):
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(h):
    return ((h >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_header(hdr_ptr, s, N, cols, cm):
    """Super-block s of rows `cols`: d and dmin as float32, and the three scale/min words."""
    h0 = tl.load(hdr_ptr + (s * 4) * N + cols, mask=cm, other=0)
    h1 = tl.load(hdr_ptr + (s * 4 + 1) * N + cols, mask=cm, other=0)
    h2 = tl.load(hdr_ptr + (s * 4 + 2) * N + cols, mask=cm, other=0)
    h3 = tl.load(hdr_ptr + (s * 4 + 3) * N + cols, mask=cm, other=0)
    return _f16_lo(h0), _f16_hi(h0), h1, h2, h3


@triton.jit
def _q4k_affine(h1, h2, h3, sub: tl.constexpr):
    """6-bit scale and min of sub-block `sub` from header words 1..3 [BN], as float32."""
    sh = (sub % 4) * 8
    a1 = (h1 >> sh) & 0xFF
    a2 = (h2 >> sh) & 0xFF
    if sub < 4:
        sc = a1 & 63
        mn = a2 & 63
    else:
        a3 = (h3 >> sh) & 0xFF
        sc = (a3 & 15) | ((a1 >> 6) << 4)
        mn = ((a3 >> 4) & 15) | ((a2 >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _plane(ptr, prow, cols, N, cm):
    """Words at plane rows `prow` [R] of weight rows `cols` [BN] -> [R, BN]."""
    return tl.load(ptr + prow[:, None] * N + cols[None, :], mask=cm[None, :], other=0)


@triton.jit
def _q6k_quarter(qla, qlb, qh, k: tl.constexpr):
    """Q6_K codes 0..63 of quarter k (4 per word) from low-nibble and high-bit words."""
    if k % 2 == 0:
        lo = qla
    else:
        lo = qlb
    return ((lo >> (4 * (k // 2))) & 0x0F0F0F0F) | (((qh >> (2 * k)) & 0x03030303) << 4)


@triton.jit
def _q8_words(qs_ptr, qh_ptr, b, lane, cols, N, cm, Q5: tl.constexpr):
    """Block b's 32 signed codes as 8 int32 words [8, BN] (4 codes each, K order, byte order the
    file's) for lane = arange(0, 8): Q8_0's plane as stored, or Q5_0's built from its 4 nibble
    words and its fifth-bit word (`Q5`). Word w's codes are elements 4w..4w+3: nibbles of qs word
    w % 4 (low for w < 4, high after), fifth bits 4w..4w+3 of qh; a Q5_0 code q - 16 is the byte
    nibble | 0xF0 where its fifth bit is clear, the nibble alone where set (two's complement),
    so the dp4a sums equal those of the widened Q8_0 blocks bit for bit."""
    if Q5:
        nib = (
            _plane(qs_ptr, b * 4 + lane % 4, cols, N, cm) >> (4 * (lane // 4))[:, None]
        ) & 0x0F0F0F0F
        h = tl.load(qh_ptr + b * N + cols, mask=cm, other=0)[None, :] >> (4 * lane)[:, None]
        five = (
            ((h << 4) & 0x10)
            | ((h << 11) & 0x1000)
            | ((h << 18) & 0x100000)
            | ((h << 25) & 0x10000000)
        )
        neg = five ^ 0x10101010  # 0x10 in each byte whose code is negative
        return nib | neg | (neg << 1) | (neg << 2) | (neg << 3)
    return _plane(qs_ptr, b * 8 + lane, cols, N, cm)


@triton.jit
def _x_rows(x8_ptr, rows, xm, K4, word0):
    """Activation code words [MP, 8] of 8 consecutive words from `word0` of each row."""
    lane = tl.arange(0, 8)
    off = rows[:, None] * K4 + word0 + lane[None, :]
    return tl.load(x8_ptr + off, mask=xm[:, None], other=0)


@triton.jit
def _finish(acc, out_ptr, part_ptr, cnt_ptr, pn, pk, rows, rmask, cols, cols_ok, PS, N, SPLIT,
            lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
            l_tiles, l_ns, l_np, MP: tl.constexpr, BN: tl.constexpr, LR: tl.constexpr,
            LS: tl.constexpr, NPC: tl.constexpr, LPS: tl.constexpr, LE: tl.constexpr):  # fmt: skip
    """Store y, or with split K: park this program's partial sums, and let the program that
    finishes its column tile last add all partials in a fixed order (deterministic, no second
    kernel) and reset the tile's counter for the next launch (CUDA-graph replays included).
    LR > 0: that program adds the tile's LoRA delta first (`triton_lora_tail`; with partials,
    NPC > 0, nothing to release after); LE: split 0's program adds it to its partial instead,
    off the tile's serial tail (t is whole before the launch: partials, no inline shrink)."""
    m2 = rmask[:, None] & cols_ok[None, :]
    yo = rows[:, None] * N + cols[None, :]
    if SPLIT == 1:
        if LR > 0:
            lora_wait(lc_ptr, l_ns, LS)
            acc += lora_tail(lt_ptr, lb_ptr, l_r, rows, rmask, pn * BN, cols, cols_ok, N,
                             l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
                             l_np, MP, BN, LR, NPC, LPS)  # fmt: skip
        tl.store(out_ptr + yo, acc, mask=m2)
        if LR > 0 and NPC == 0:
            lora_release(lt_ptr, lc_ptr, l_r, rows, rmask, l_tiles, MP)
    else:
        if LR > 0 and LE:  # noqa: SIM102 (constexprs: compiled out, apart from the runtime test)
            if pk == 0:
                acc += lora_tail(lt_ptr, lb_ptr, l_r, rows, rmask, pn * BN, cols, cols_ok, N,
                                 l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
                                 l_np, MP, BN, LR, NPC, LPS)  # fmt: skip
        tl.store(part_ptr + pk * PS + yo, acc, mask=m2)
        tl.debug_barrier()  # every thread's partial is written before the tile's counter moves
        done = tl.atomic_add(cnt_ptr + pn, 1, sem="acq_rel")
        if done == SPLIT - 1:
            if LR > 0 and not LE:  # its loads go out before the partials' (latency, not bytes)
                lora_wait(lc_ptr, l_ns, LS)
                tot = lora_tail(lt_ptr, lb_ptr, l_r, rows, rmask, pn * BN, cols, cols_ok, N,
                                l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
                                l_np, MP, BN, LR, NPC, LPS)  # fmt: skip
            else:
                tot = tl.zeros(acc.shape, dtype=tl.float32)
            for j in range(0, SPLIT):  # L1 is not coherent across SMs: read partials from L2
                tot += tl.load(part_ptr + j * PS + yo, mask=m2, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + yo, tot, mask=m2)
            tl.atomic_xchg(cnt_ptr + pn, 0)
            if LR > 0 and NPC == 0:
                lora_release(lt_ptr, lc_ptr, l_r, rows, rmask, l_tiles, MP)


@triton.jit
def _pair(ids_ptr, XDIV, P, M, N, BN: tl.constexpr, MOE: tl.constexpr):
    """Grouped (MoE) launches: grid axis 2 is a (token, choice) pair of one activation row and one
    expert's planes. Returns (expert, activation row, output row, partial-sum stride, first
    counter); a plain launch gets zeros and its M rows."""
    if MOE:
        pair = tl.program_id(2)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        xr = pair // XDIV
        ps = P * N
        cb = pair * tl.cdiv(N, BN)
    else:
        pair = 0
        e = 0
        xr = 0
        ps = M * N
        cb = 0
    return e, xr, pair, ps, cb


@triton.jit
def _gemv_q4k_packed(
    x8_ptr, xd_ptr, xsum_ptr, qs_ptr, hdr_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr, M, N, K, nb,
    XDIV, P, spb: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr,
    ASM: tl.constexpr, MOE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
    LATE: tl.constexpr, lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0,
    l_rk1, l_rk2, l_tiles, ls_ptr, l_sx, la_ptr, lw_ptr, l_sw, l_ns, l_np,
    LR: tl.constexpr, LS: tl.constexpr, NPC: tl.constexpr, LPS: tl.constexpr,
    LE: tl.constexpr = False,
    STAGES: tl.constexpr = 1,
):  # fmt: skip
    pn, pk, tk = lora_program(lc_ptr, LS)  # (LS: the LoRA shrink inline, tickets)
    if not LATE:  # else once the weights are read: one kernel ahead, not a chain
        gdc_begin(PDL)
    if PF and not MOE:  # the weight does not depend on earlier kernels: fetch its first block
        s0 = pk * spb
        prefetch_plane(qs_ptr, s0 * 32, 32, pn * BN, N, s0 < nb, BN, PDL)
        prefetch_plane(hdr_ptr, s0 * 4, 4, pn * BN, N, s0 < nb, BN, PDL)
    gdc_wait(PDL)
    lora_shrink_item(tk, l_ns, ls_ptr, l_sx, la_ptr, lw_ptr, l_sw, lt_ptr, lc_ptr, M, K, l_r, MP,
                     LS, ASM)  # fmt: skip
    cols = pn * BN + tl.arange(0, BN)
    cols_ok = cols < N
    rows = tl.arange(0, MP)
    rmask = rows < M
    lane = tl.arange(0, 8)
    K4, K32 = K // 4, K // 32
    e, xr, orow, ps, cb = _pair(ids_ptr, XDIV, P, M, N, BN, MOE)
    qs_ptr += e * (nb * 32 * N)
    hdr_ptr += e * (nb * 4 * N)
    x8_ptr += xr * K4
    xd_ptr += xr * K32
    xsum_ptr += xr * K32
    out_ptr += orow * N
    part_ptr += orow * N
    cnt_ptr += cb
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    for i in tl.range(0, spb, num_stages=STAGES):  # STAGES > 1: cp.async stages
        s = pk * spb + i
        real = s < nb  # the last program's chunk may run past the row
        cm = cols_ok & real
        xm = rmask & real
        d, dmin, h1, h2, h3 = _q4k_header(hdr_ptr, s, N, cols, cm)
        for jj in tl.static_range(4):
            w = _plane(qs_ptr, s * 32 + jj * 8 + lane, cols, N, cm)  # [8, BN]
            for h in tl.static_range(2):
                sub = 2 * jj + h
                q = (w >> (4 * h)) & 0x0F0F0F0F
                xw = _x_rows(x8_ptr, rows, xm, K4, s * 64 + sub * 8)  # [MP, 8]
                p = _dp4a(q[None, :, :], xw[:, :, None], False, ASM)  # [MP, 8, BN]
                isum = tl.sum(p, axis=1).to(tl.float32)  # [MP, BN]
                sc, mn = _q4k_affine(h1, h2, h3, sub)
                dx = tl.load(xd_ptr + rows * K32 + s * 8 + sub, mask=xm, other=0.0)
                xs = tl.load(xsum_ptr + rows * K32 + s * 8 + sub, mask=xm, other=0.0)
                acc += (d * sc)[None, :] * (dx[:, None] * isum) - (dmin * mn)[None, :] * xs[:, None]
    if LATE:
        gdc_begin(PDL)
    _finish(acc, out_ptr, part_ptr, cnt_ptr, pn, pk, rows, rmask, cols, cols_ok, ps, N, SPLIT,
            lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
            l_tiles, l_ns, l_np, MP, BN, LR, LS, NPC, LPS, LE)  # fmt: skip


@triton.jit
def _gemv_q6k_packed(
    x8_ptr, xd_ptr, s16_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr,
    M, N, K, nb, XDIV, P, spb: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr,
    BN: tl.constexpr, ASM: tl.constexpr, MOE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
    LATE: tl.constexpr, lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0,
    l_rk1, l_rk2, l_tiles, ls_ptr, l_sx, la_ptr, lw_ptr, l_sw, l_ns, l_np,
    LR: tl.constexpr, LS: tl.constexpr, NPC: tl.constexpr, LPS: tl.constexpr,
    LE: tl.constexpr = False,
    STAGES: tl.constexpr = 1,
):  # fmt: skip
    pn, pk, tk = lora_program(lc_ptr, LS)  # (LS: the LoRA shrink inline, tickets)
    if not LATE:  # else once the weights are read: one kernel ahead, not a chain
        gdc_begin(PDL)
    if PF and not MOE:
        s0 = pk * spb
        prefetch_plane(ql_ptr, s0 * 32, 32, pn * BN, N, s0 < nb, BN, PDL)
        prefetch_plane(qh_ptr, s0 * 16, 16, pn * BN, N, s0 < nb, BN, PDL)
        prefetch_plane(sc_ptr, s0 * 4, 4, pn * BN, N, s0 < nb, BN, PDL)
        prefetch_plane(d_ptr, s0, 1, pn * BN, N, s0 < nb, BN, PDL)
    gdc_wait(PDL)
    lora_shrink_item(tk, l_ns, ls_ptr, l_sx, la_ptr, lw_ptr, l_sw, lt_ptr, lc_ptr, M, K, l_r, MP,
                     LS, ASM)  # fmt: skip
    cols = pn * BN + tl.arange(0, BN)
    cols_ok = cols < N
    rows = tl.arange(0, MP)
    rmask = rows < M
    l4 = tl.arange(0, 4)
    K4, K16, K32 = K // 4, K // 16, K // 32
    e, xr, orow, ps, cb = _pair(ids_ptr, XDIV, P, M, N, BN, MOE)
    ql_ptr += e * (nb * 32 * N)
    qh_ptr += e * (nb * 16 * N)
    sc_ptr += e * (nb * 4 * N)
    d_ptr += e * (nb * N)
    x8_ptr += xr * K4
    xd_ptr += xr * K32
    s16_ptr += xr * K16
    out_ptr += orow * N
    part_ptr += orow * N
    cnt_ptr += cb
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    for i in tl.range(0, spb, num_stages=STAGES):  # STAGES > 1: cp.async stages
        s = pk * spb + i
        real = s < nb  # the last program's chunk may run past the row
        cm = cols_ok & real
        xm = rmask & real
        d = tl.load(d_ptr + s * N + cols, mask=cm, other=0.0).to(tl.float32)
        for hf in tl.static_range(2):
            for g in tl.static_range(2):  # lanes 4g..4g+3: one 16-value scale group per quarter
                lane = 4 * g + l4
                qla = _plane(ql_ptr, s * 32 + hf * 16 + lane, cols, N, cm)  # [4, BN]
                qlb = _plane(ql_ptr, s * 32 + hf * 16 + 8 + lane, cols, N, cm)
                qh = _plane(qh_ptr, s * 16 + hf * 8 + lane, cols, N, cm)
                for k in tl.static_range(4):
                    q = _q6k_quarter(qla, qlb, qh, k)
                    xo = rows[:, None] * K4 + s * 64 + hf * 32 + 8 * k + lane[None, :]
                    xw = tl.load(x8_ptr + xo, mask=xm[:, None], other=0)  # [MP, 4]
                    p = _dp4a(q[None, :, :], xw[:, :, None], False, ASM)
                    isum = tl.sum(p, axis=1)  # [MP, BN]
                    grp = hf * 8 + 2 * k + g
                    scw = tl.load(sc_ptr + (s * 4 + grp // 4) * N + cols, mask=cm, other=0)
                    sc = ((scw << (24 - 8 * (grp % 4))) >> 24).to(tl.float32)
                    x16 = tl.load(s16_ptr + rows * K16 + s * 16 + grp, mask=xm, other=0)
                    dx = tl.load(xd_ptr + rows * K32 + s * 8 + grp // 2, mask=xm, other=0.0)
                    t = (isum - 32 * x16[:, None]).to(tl.float32) * dx[:, None]
                    acc += (d * sc)[None, :] * t
    if LATE:
        gdc_begin(PDL)
    _finish(acc, out_ptr, part_ptr, cnt_ptr, pn, pk, rows, rmask, cols, cols_ok, ps, N, SPLIT,
            lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
            l_tiles, l_ns, l_np, MP, BN, LR, LS, NPC, LPS, LE)  # fmt: skip


@triton.jit
def _gemv_q8_0_packed(
    x8_ptr, xd_ptr, qs_ptr, d_ptr, qh_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr, M, N, K, nb, XDIV,
    P, spb: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr,
    ASM: tl.constexpr, MOE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
    LATE: tl.constexpr, lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0,
    l_rk1, l_rk2, l_tiles, ls_ptr, l_sx, la_ptr, lw_ptr, l_sw, l_ns, l_np,
    LR: tl.constexpr, LS: tl.constexpr, NPC: tl.constexpr, LPS: tl.constexpr,
    LE: tl.constexpr = False,
    STAGES: tl.constexpr = 1,
    Q5: tl.constexpr = False,
):  # fmt: skip
    # Q5: Q5_0 planes (qs 4 words a block, qh 1; `_q8_words`), else Q8_0 (qs 8, qh unused)
    WB: tl.constexpr = 4 if Q5 else 8
    pn, pk, tk = lora_program(lc_ptr, LS)  # (LS: the LoRA shrink inline, tickets)
    if not LATE:  # else once the weights are read: one kernel ahead, not a chain
        gdc_begin(PDL)
    if PF and not MOE:
        for i in tl.static_range(4):  # up to 4 blocks of 32 values (WB plane rows each)
            if i < spb:
                b0 = pk * spb + i
                prefetch_plane(qs_ptr, b0 * WB, WB, pn * BN, N, b0 < nb, BN, PDL)
                prefetch_plane(d_ptr, b0, 1, pn * BN, N, b0 < nb, BN, PDL)
                if Q5:
                    prefetch_plane(qh_ptr, b0, 1, pn * BN, N, b0 < nb, BN, PDL)
    gdc_wait(PDL)
    lora_shrink_item(tk, l_ns, ls_ptr, l_sx, la_ptr, lw_ptr, l_sw, lt_ptr, lc_ptr, M, K, l_r, MP,
                     LS, ASM)  # fmt: skip
    cols = pn * BN + tl.arange(0, BN)
    cols_ok = cols < N
    rows = tl.arange(0, MP)
    rmask = rows < M
    lane = tl.arange(0, 8)
    K4, K32 = K // 4, K // 32
    e, xr, orow, ps, cb = _pair(ids_ptr, XDIV, P, M, N, BN, MOE)
    qs_ptr += e * (nb * WB * N)
    d_ptr += e * (nb * N)
    if Q5:
        qh_ptr += e * (nb * N)
    x8_ptr += xr * K4
    xd_ptr += xr * K32
    out_ptr += orow * N
    part_ptr += orow * N
    cnt_ptr += cb
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    for i in tl.range(0, spb, num_stages=STAGES):  # STAGES > 1: cp.async stages
        b = pk * spb + i
        real = b < nb
        cm = cols_ok & real
        xm = rmask & real
        w = _q8_words(qs_ptr, qh_ptr, b, lane, cols, N, cm, Q5)
        d = tl.load(d_ptr + b * N + cols, mask=cm, other=0.0).to(tl.float32)
        xw = _x_rows(x8_ptr, rows, xm, K4, b * 8)
        isum = tl.sum(_dp4a(w[None, :, :], xw[:, :, None], True, ASM), axis=1).to(tl.float32)
        dx = tl.load(xd_ptr + rows * K32 + b, mask=xm, other=0.0)
        acc += d[None, :] * (dx[:, None] * isum)
    if LATE:
        gdc_begin(PDL)
    _finish(acc, out_ptr, part_ptr, cnt_ptr, pn, pk, rows, rmask, cols, cols_ok, ps, N, SPLIT,
            lt_ptr, lb_ptr, lc_ptr, l_r, l_e1, l_e2, l_lo0, l_lo1, l_lo2, l_rk0, l_rk1, l_rk2,
            l_tiles, l_ns, l_np, MP, BN, LR, LS, NPC, LPS, LE)  # fmt: skip
