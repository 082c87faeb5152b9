"""Triton kernels of `decode` (CUDA; or CPU tensors under TRITON_INTERPRET=1 in tests): a decode
step of Gated DeltaNet's rule and of the causal short conv, reading and writing the sequences'
state slots in place. float32 state and sums, like the references.

The delta rule: one program per (sequence, value head, block of BV value columns) holds its
[Dk, BV] tile of the state in registers: decay, the delta update and the output read happen on
the tile without a round trip to memory (the state is read and written once per step, the floor
for a memory-bound decode). The conv: one program per (sequence, block of BC channels).
"""

import torch
import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import quant_groups
from localllm.kernels.quant.triton_packed import quantized_out
from localllm.kernels.recurrent.triton_step import fresh_flags


@triton.jit
def _gated_delta(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, slot_ptr, fresh_ptr, o_ptr,
    ba_ptr, dt_ptr, a_ptr, SBA,
    HK, HV, DK, DV, REP, scale, eps,
    BK: tl.constexpr, BV: tl.constexpr, RAW: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BK)
    mk, mv = rows < DK, cols < DV
    kh = h // REP  # the key head serving this value head
    q = tl.load(q_ptr + (b * HK + kh) * DK + rows, mask=mk, other=0.0)
    k = tl.load(k_ptr + (b * HK + kh) * DK + rows, mask=mk, other=0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + (b * HV + h) * DV + cols, mask=mv, other=0.0)
    if RAW:  # from the projection's row (row stride SBA): per key head b, then a, for its
        # REP value heads; beta = sigmoid(b), g = ssm_a * softplus(a + dt bias)
        at = ba_ptr + b * SBA + kh * 2 * REP + h % REP
        beta = tl.sigmoid(tl.load(at).to(tl.float32))
        x = tl.load(at + REP).to(tl.float32) + tl.load(dt_ptr + h)
        soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's
        g = tl.load(a_ptr + h) * soft
    else:
        g = tl.load(g_ptr + b * HV + h)
        beta = tl.load(b_ptr + b * HV + h)
    slot = tl.load(slot_ptr + b)
    base = s_ptr + (slot * HV + h) * DK * DV
    tile = base + rows[:, None] * DV + cols[None, :]
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=m2, other=0.0)
    fresh = tl.load(fresh_ptr + b)
    s = tl.where(fresh != 0, 0.0, s) * tl.exp(g)  # where: a fresh slot may hold anything
    pred = tl.sum(s * k[:, None], axis=0)
    delta = (v - pred) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=m2)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + (b * HV + h) * DV + cols, o, mask=mv)


def gated_delta_decode_cuda(q, k, v, g, beta, states, slots, fresh, eps: float,
                            raw=None) -> torch.Tensor:  # fmt: skip
    """`decode.gated_delta_decode_ref` in one launch; `raw` = (ba [B, 2 * Hv] with contiguous
    rows, dt bias [Hv], ssm_a [Hv]): g and beta made in the kernel from the projection's row
    (`decode.gated_delta_raw_ref`; then g and beta are None)."""
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    out = torch.empty(bsz, hv, dv, dtype=torch.float32, device=v.device)
    if raw is None:
        g, beta = g.float().contiguous(), beta.float().contiguous()
        ba, dt, a, sba = out, out, out, 0  # (unread)
    else:
        ba, dt, a = raw
        ba = ba if ba.stride(-1) == 1 else ba.contiguous()
        dt, a, sba = dt.float().contiguous(), a.float().contiguous(), ba.stride(0)
        g, beta = dt, a  # (unread)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 4096 // bk))  # a tile of at most 4096 values
    grid = (bsz, hv, triton.cdiv(dv, bv))
    _gated_delta[grid](
        q, k, v, g, beta, states, slots, fresh_flags(fresh), out, ba, dt, a, sba,
        hk, hv, dk, dv, hv // hk, dk**-0.5, eps, BK=bk, BV=bv, RAW=raw is not None,
    )  # fmt: skip
    return out


@triton.jit
def _norm_gate(
    o_ptr, z_ptr, w_ptr, y_ptr, q_ptr, qd_ptr, s16_ptr, xs_ptr, SZ, H, D, eps,
    BD: tl.constexpr, QUANT: tl.constexpr, RN: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BD)
    m = c < D
    o = tl.load(o_ptr + (t * H + h) * D + c, mask=m, other=0.0)
    z = tl.load(z_ptr + t * SZ + h * D + c, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    y = o * r * w * (z * tl.sigmoid(z))
    tl.store(y_ptr + (t * H + h) * D + c, y, mask=m)
    if QUANT:  # ssm_out's int8 rows (D a multiple of 32: the head's blocks are whole ones)
        k = H * D
        j = h * (D // 32) + tl.arange(0, BD // 32)
        k32 = t * (k // 32)
        quant_groups(tl.reshape(y, (BD // 32, 32)), j, tl.arange(0, BD // 32) < D // 32,
                     q_ptr + t * (k // 4), qd_ptr + k32, s16_ptr + t * (k // 16), xs_ptr + k32,
                     BD // 32, RN)  # fmt: skip


def norm_gate_cuda(o, z, weight, eps: float, dtype: torch.dtype, quant: bool = False):
    """`decode.norm_gate_ref` in one launch: o [T, H, D] float32, z [T, H * D] (contiguous
    rows, any row stride), weight [D] -> [T, H * D] in `dtype`; with `quant` (that, its int8
    rows for ssm_out's GEMV or None where they cannot be made: not float32, D no multiple of
    32), what `quantize_x8` makes of it."""
    t, h, d = o.shape
    o = o.float().contiguous()
    z = z if z.stride(-1) == 1 else z.contiguous()
    y = torch.empty(t, h * d, dtype=dtype, device=o.device)
    bd = triton.next_power_of_2(d)
    # (a head's blocks must be whole 32s of the row: D, not only H * D, a multiple of 32)
    xq, qa = quantized_out(t, h * d, quant and dtype == torch.float32 and d % 32 == 0, y)
    _norm_gate[(t, h)](o, z, weight.float().contiguous(), y, *qa, z.stride(0), h, d, eps,
                       BD=bd, QUANT=xq is not None, RN=o.is_cuda)  # fmt: skip
    return (y, xq) if quant else y


@triton.jit
def _conv(
    x_ptr, w_ptr, s_ptr, slot_ptr, fresh_ptr, y_ptr, C,
    K: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = c < C
    slot = tl.load(slot_ptr + b)
    fresh = tl.load(fresh_ptr + b)
    base = s_ptr + slot * (K - 1) * C
    x = tl.load(x_ptr + b * C + c, mask=m, other=0.0)
    acc = x * tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0)  # the newest input, last tap
    for j in tl.static_range(K - 1):  # oldest first; each row moves one place up
        row = tl.load(base + j * C + c, mask=m, other=0.0)
        row = tl.where(fresh != 0, 0.0, row)
        acc += row * tl.load(w_ptr + c * K + j, mask=m, other=0.0)
        if j > 0:
            tl.store(base + (j - 1) * C + c, row, mask=m)
    tl.store(base + (K - 2) * C + c, x, mask=m)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + b * C + c, y, mask=m)


def conv_decode_cuda(x, weight, states, slots, fresh) -> torch.Tensor:
    bsz, c = x.shape
    kk = weight.shape[1]
    x, weight = x.float().contiguous(), weight.float().contiguous()
    out = torch.empty(bsz, c, dtype=torch.float32, device=x.device)
    bc = 256
    fr = fresh_flags(fresh)
    _conv[(bsz, triton.cdiv(c, bc))](x, weight, states, slots, fr, out, c, K=kk, BC=bc)
    return out


@triton.jit
def _chunk_scan(
    qd_ptr, in_ptr, u_ptr, w_ptr, kd_ptr, e_ptr, s_ptr, o_ptr, N, DK, DV,
    L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ks, ls = tl.arange(0, BK), tl.arange(0, L)
    mk, mv = ks < DK, cols < DV
    tile = s_ptr + h * DK * DV + ks[:, None] * DV + cols[None, :]
    s = tl.load(tile, mask=mk[:, None] & mv[None, :], other=0.0)
    for n in range(N):
        blk = h * N + n
        lk = blk * L * DK + ls[:, None] * DK + ks[None, :]  # [L, BK] rows of a block
        lv = blk * L * DV + ls[:, None] * DV + cols[None, :]  # [L, BV]
        w = tl.load(w_ptr + lk, mask=mk[None, :], other=0.0)
        vn = tl.load(u_ptr + lv, mask=mv[None, :], other=0.0)
        vn -= tl.dot(w, s, input_precision="ieee")
        qd = tl.load(qd_ptr + lk, mask=mk[None, :], other=0.0)
        a = tl.load(in_ptr + blk * L * L + ls[:, None] * L + ls[None, :])
        o = tl.dot(qd, s, input_precision="ieee") + tl.dot(a, vn, input_precision="ieee")
        tl.store(o_ptr + lv, o, mask=mv[None, :])
        kd = tl.load(kd_ptr + lk, mask=mk[None, :], other=0.0)
        s = tl.load(e_ptr + blk) * s + tl.dot(tl.trans(kd), vn, input_precision="ieee")
    tl.store(tile, s, mask=mk[:, None] & mv[None, :])


def chunk_scan_cuda(qd, intra, u0, w, kd, e, state) -> torch.Tensor:
    """`delta_rule.chunk_scan_ref` in one launch: a program per (head, BV value columns)."""
    h, n, L, dk = qd.shape
    dv = u0.shape[-1]
    qd, intra, u0, w, kd, e = (t.contiguous() for t in (qd, intra, u0, w, kd, e))
    out = torch.empty_like(u0)
    bk = max(16, triton.next_power_of_2(dk))  # tl.dot takes sides of 16 and more
    bv = max(16, min(triton.next_power_of_2(dv), 32))
    # one stage: the loop's software pipelining of 128-wide tiles asked 256 KiB of shared
    # memory, more than an H100's 227 KiB (OutOfResources at dk = dv = 128)
    _chunk_scan[(h, triton.cdiv(dv, bv))](qd, intra, u0, w, kd, e, state, out, n, dk, dv,
                                          L=L, BK=bk, BV=bv, num_stages=1)  # fmt: skip
    return out
