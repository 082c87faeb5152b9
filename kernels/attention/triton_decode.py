"""Flash-decoding over a `DecodePlan` on CUDA: single-token queries against paged f16/bf16/f32
keys and values, in two launches (split the keys, then combine) instead of the reference's
gather + two batched matmuls + mask + softmax (6-8 kernels per layer, the bulk of decode's
non-GEMV time on an H200). The plan's slots/pad are read on the device, so CUDA graphs replay it.

Reference: `decode.decode_attention` (same arguments); quantized KV caches and attention sinks
stay on the reference.
"""

import torch
import triton
import triton.language as tl

from localllm.kernels.attention.decode import DecodePlan

PROGRAM_TARGET = 264  # (sequence, kv head, key chunk) programs: two per SM of an H100/H200
# Values of the [heads, keys, dims] score product one program holds: with 8 warps, 64 registers
# a thread. A chunk within this runs in one pass: its k and v loads go out together (decode
# attention on a GPU is bound by load latency, not bytes).
PRODUCT_VALUES = 16384


@triton.jit
def _split_kernel(
    q_ptr, rows_ptr, k_ptr, v_ptr, slots_ptr, pad_ptr, m_ptr, l_ptr, acc_ptr,
    M, NS, scale, softcap, CHUNK: tl.constexpr,
    KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BJ: tl.constexpr, HAS_PAD: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    b, g, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    gi = tl.arange(0, GP)
    gm = gi < G
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    row = tl.load(rows_ptr + b)
    qo = (row * KV * G + g * G + gi)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qo, mask=gm[:, None], other=0.0).to(tl.float32) * scale
    mx = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DV], dtype=tl.float32)
    for i in range(CHUNK // BJ):  # constexpr trip count (a power of two: few compiled variants)
        j = c * CHUNK + i * BJ + tl.arange(0, BJ)
        ok = j < M
        slot = tl.load(slots_ptr + b.to(tl.int64) * M + j, mask=ok, other=0)
        if HAS_PAD:
            ok &= tl.load(pad_ptr + b.to(tl.int64) * M + j, mask=ok, other=1) == 0
        base = slot * KV + g
        # v is loaded with k, not after the softmax: both round trips overlap
        k = tl.load(k_ptr + base[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] * DV + dv[None, :], mask=ok[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [GP, BJ]
        if CAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # cap * tanh(s / cap)
        s = tl.where(ok[None, :], s, float("-inf"))
        new = tl.maximum(mx, tl.max(s, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)  # a chunk of padding only: no NaN
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(mx - safe)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        den = den * alpha + tl.sum(p, axis=1)
        mx = new
    part = (b * KV + g) * NS + c
    tl.store(m_ptr + part * GP + gi, mx)
    tl.store(l_ptr + part * GP + gi, den)
    tl.store(acc_ptr + (part * GP + gi)[:, None] * DV + dv[None, :], acc)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, rows_ptr, out_ptr, NS, KV: tl.constexpr, G: tl.constexpr,
    GP: tl.constexpr, DV: tl.constexpr, NSP: tl.constexpr,
):  # fmt: skip
    """Merge a head group's chunk partials one chunk at a time (running max, rescaled sums: the
    registers hold one [GP, DV] partial whatever the chunk count) into output row rows[b]."""
    b, g = tl.program_id(0), tl.program_id(1)
    gi = tl.arange(0, GP)
    dv = tl.arange(0, DV)
    top = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DV], dtype=tl.float32)
    for c in range(0, NSP):  # constexpr bound (a power of two >= NS): few compiled variants
        part = (b * KV + g) * NS + c
        live = (gi * 0 + c) < NS
        mc = tl.load(m_ptr + part * GP + gi, mask=live, other=float("-inf"))
        new = tl.maximum(top, mc)
        safe = tl.where(new == float("-inf"), 0.0, new)  # no key seen yet: weights stay 0
        a_old = tl.exp(top - safe)
        a_new = tl.exp(mc - safe)
        den = den * a_old + a_new * tl.load(l_ptr + part * GP + gi, mask=live, other=0.0)
        ao = (part * GP + gi)[:, None] * DV + dv[None, :]
        chunk = tl.load(acc_ptr + ao, mask=live[:, None], other=0.0)
        acc = acc * a_old[:, None] + a_new[:, None] * chunk
        top = new
    row = tl.load(rows_ptr + b)
    oo = (row * KV * G + g * G + gi)[:, None] * DV + dv[None, :]
    tl.store(out_ptr + oo, acc / den[:, None], mask=(gi < G)[:, None])


def supports(k_cache: torch.Tensor, k_scales, sinks) -> bool:
    """Caches the kernel reads: unquantized f16/bf16/f32, no sinks, power-of-two head dims."""
    d = k_cache.shape[-1]
    return (
        k_cache.is_cuda
        and k_scales is None
        and sinks is None
        and k_cache.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and d == triton.next_power_of_2(d)
    )


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` for unquantized caches: q [T, H, D] float32 -> [nd, H, Dv] float32.
    With `out` [T, H, Dv] the results go straight to the plan's rows of it (returned)."""
    nd, m = plan.slots.shape
    _, _, kvh, d = k_cache.shape
    dv = v_cache.shape[-1]
    h = q.shape[1]
    g = h // kvh
    gp = triton.next_power_of_2(g)
    bj = 16
    ns = max(1, min(triton.cdiv(m, bj), triton.cdiv(PROGRAM_TARGET, nd * kvh)))
    chunk = max(bj, triton.next_power_of_2(triton.cdiv(m, ns)))
    ns = triton.cdiv(m, chunk)
    fit = max(1, PRODUCT_VALUES // (gp * max(d, dv)))
    bj = max(bj, min(chunk, 1 << (fit.bit_length() - 1)))  # a power of two within the budget
    dev = q.device
    mx = torch.empty(nd * kvh * ns * gp, dtype=torch.float32, device=dev)
    den = torch.empty_like(mx)
    acc = torch.empty(nd * kvh * ns * gp, dv, dtype=torch.float32, device=dev)
    pad = plan.pad.reshape(nd, m) if plan.pad is not None else plan.slots
    slots = plan.slots.contiguous()
    qc = q.contiguous()
    _split_kernel[(nd, kvh, ns)](
        qc, plan.rows, k_cache, v_cache, slots, pad.contiguous(), mx, den, acc,
        m, ns, scale, softcap or 0.0, CHUNK=chunk,
        KV=kvh, G=g, GP=gp, D=d, DV=dv, BJ=bj, HAS_PAD=plan.pad is not None,
        CAP=softcap is not None, num_warps=8,
    )  # fmt: skip
    if out is None:
        out = torch.empty(nd, h, dv, dtype=torch.float32, device=dev)
        rows = torch.arange(nd, device=dev)
    else:
        rows = plan.rows
    nsp = triton.next_power_of_2(ns)
    _combine_kernel[(nd, kvh)](mx, den, acc, rows, out, ns, KV=kvh, G=g, GP=gp, DV=dv, NSP=nsp)
    return out
