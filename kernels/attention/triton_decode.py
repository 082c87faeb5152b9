"""Flash-decoding over a `DecodePlan` on CUDA: single-token queries against paged f16/bf16/f32
keys and values, in two launches (split the keys, then combine) instead of the reference's
gather + two batched matmuls + mask + softmax (6-8 kernels per layer, the bulk of decode's
non-GEMV time on an H200). The plan's slots/pad (and span) are read on the device, so CUDA graphs
replay it. The split on tensor cores is `triton_split`'s (`SPLIT_KERNEL`); this module keeps the
earlier splits (FMA, and the chunk split for A/B) and the combine.

Reference: `decode.decode_attention` (same arguments); quantized KV caches and attention sinks
stay on the reference. tests/kernels/test_flash_decode.py checks every split against it.
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.attention.decode_plan import DecodePlan
from localllm.kernels.attention.triton_split import split_span
from localllm.kernels.fused.triton_lora import a_rows, shrink_rows
from localllm.kernels.quant.triton_dp4a import quant_groups
from localllm.kernels.quant.triton_packed import QuantizedX

# The chunk and FMA splits' launch:
PROGRAM_TARGET = 264  # (sequence, kv head, key chunk) programs: two per SM of an H100/H200
# Values of the [heads, keys, dims] score product one program holds. A chunk within this runs in
# one pass: its k and v loads go out together (decode attention on a GPU is bound by load
# latency, not bytes). 4 warps: 6-34 us per layer at 256-4,096 keys for the Llama-3-8B and
# Qwen3-30B-A3B shapes, 8 warps 0-60 % slower (H200, tests/perf/bench_attention.py).
PRODUCT_VALUES = 16384
COMBINE_VALUES = 8192  # partial-sum values one combine program loads at once (64 registers)
COMBINE_WARPS = 4  # warps of a combine program (one query head)
# with the output projection's LoRA shrink, split its A rows over this many per combine program
# (a third grid axis; each such program merges its head again and only the first stores) instead
# of one program a head looping over all R. None: no split; a multiple of the kernel's BRS (8).
# On with the SiLU's (`triton_ops.SILU_LORA_RSTEP`, measured together on an H200, 2026-12-07)
COMBINE_LORA_RSTEP: int | None = 8
# with a shrink, each combine program's first rows of A load before it waits for the split
# kernel (PDL); off, as `triton_ops.SILU_LORA_PREFETCH` (not yet timed alone)
COMBINE_LORA_PREFETCH = False
# The split on tensor cores (`_split_dot_kernel`): None (the FMA split), "exact" or "native" (see
# the kernel). "exact" (float32 in three tf32 passes, 5e-8 off) takes 8.1 / 17.7 us per 8B layer at
# 513 / 4,000 keys where the FMA split takes 12.1 / 35.2 (H200, bench_attention.py, 2026-12-01).
SPLIT_DOT: str | None = "exact"
# Which tensor-core split runs: "span" (`triton_split`: each sequence's real keys in many short
# splits, f16/bf16 keys as stored; issue 38's long contexts) or "chunk" (`_split_dot_kernel` over
# all m keys of the plan in fixed chunks: at depth 8K on an H100 1,707 us a decode step, 21 % of
# the copy bandwidth, tests/perf/results/server.md; kept for A/B in bench_attention.py and
# tests/perf/gpu_flashdecode.sh)
SPLIT_KERNEL = "span"
# The combine also writes its rows quantized for the output projection's dp4a GEMV, which then
# skips its own quantization launch (`decode.quantized_output`; tests/perf/h200_session.sh `pdlab`
# mode `nocq` turns it off)
COMBINE_QUANT = True


@triton.jit
def _split_kernel(
    q_ptr, rows_ptr, k_ptr, v_ptr, slots_ptr, pad_ptr, m_ptr, l_ptr, acc_ptr,
    M, NS, scale, softcap, CHUNK: tl.constexpr,
    KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BJ: tl.constexpr, HAS_PAD: tl.constexpr, CAP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
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
def _split_dot_kernel(
    q_ptr, rows_ptr, k_ptr, v_ptr, slots_ptr, pad_ptr, m_ptr, l_ptr, acc_ptr,
    M, NS, scale, softcap, CHUNK: tl.constexpr,
    KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GH: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, BJ: tl.constexpr, HAS_PAD: tl.constexpr, CAP: tl.constexpr,
    EXACT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`_split_kernel` with both products on tensor cores, the group's query heads padded to GH
    (>= 16) rows. EXACT: float32 operands in three tf32 passes (~float32 products); else q and
    the softmax weights are rounded to the cache's type (llama.cpp's flash attention does so)."""
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    b, g, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    gi = tl.arange(0, GH)
    gm = gi < G
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    row = tl.load(rows_ptr + b)
    qo = (row * KV * G + g * G + gi)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qo, mask=gm[:, None], other=0.0).to(tl.float32) * scale
    mx = tl.full([GH], float("-inf"), tl.float32)
    den = tl.zeros([GH], dtype=tl.float32)
    acc = tl.zeros([GH, DV], dtype=tl.float32)
    for i in range(CHUNK // BJ):
        j = c * CHUNK + i * BJ + tl.arange(0, BJ)
        ok = j < M
        slot = tl.load(slots_ptr + b.to(tl.int64) * M + j, mask=ok, other=0)
        if HAS_PAD:
            ok &= tl.load(pad_ptr + b.to(tl.int64) * M + j, mask=ok, other=1) == 0
        base = slot * KV + g
        k = tl.load(k_ptr + base[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] * DV + dv[None, :], mask=ok[:, None], other=0.0)
        if EXACT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32x3")  # [GH, BJ]
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        if CAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(ok[None, :], s, float("-inf"))
        new = tl.maximum(mx, tl.max(s, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(mx - safe)
        if EXACT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        den = den * alpha + tl.sum(p, axis=1)
        mx = new
    part = (b * KV + g) * NS + c
    keep = gi < GP  # the partials are laid out for GP heads per group
    tl.store(m_ptr + part * GP + gi, mx, mask=keep)
    tl.store(l_ptr + part * GP + gi, den, mask=keep)
    tl.store(acc_ptr + (part * GP + gi)[:, None] * DV + dv[None, :], acc, mask=keep[:, None])


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, rows_ptr, out_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, a_ptr, lw_ptr, t_ptr,
    NS, slw, R, RSTEP, PS,
    KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DV: tl.constexpr, CB: tl.constexpr,
    NSP: tl.constexpr, QUANT: tl.constexpr, RN: tl.constexpr, PDL: tl.constexpr,
    LORA: tl.constexpr = False, BRS: tl.constexpr = 8, PART: tl.constexpr = False,
    APF: tl.constexpr = False,
):  # fmt: skip
    """One query head per program: merge its chunk partials CB chunks at a time (one round trip
    of loads for up to CB chunks; a running max across blocks) into output row rows[b]. QUANT:
    also quantize the head's DV values (whole 32-value groups of the row) into the row's
    `QuantizedX` buffers, as `quantize_x8` of the float output would. LORA: add the head's share
    of the output projection's LoRA shrink (its DV columns of the stacked A, times W) into the
    projection's scratch t with float32 atomics (`lora_delta.LoraShrink`; t zero before): rows
    r * RSTEP.. of A for grid axis 2's program r (one program and RSTEP = R unless the shrink is
    split: then every r merges the head and the r = 0 program stores it). PART: the head's share
    stored as its partial instead (t[row, r, head], `LoraShrink.ps`; the epilogue sums them).
    APF: the head's first BRS rows of A load before the wait for the split kernel (a weight)."""
    pdl.gdc_begin(PDL)
    b, hh = tl.program_id(0), tl.program_id(1)
    g, gi = hh // G, hh % G
    dv = tl.arange(0, DV)
    cols = (hh * DV + dv).to(tl.int64)
    lo = tl.program_id(2) * RSTEP
    if LORA and APF:
        a0 = a_rows(a_ptr, lo + tl.arange(0, BRS), cols, dv < DV, KV * G * DV, R)
    pdl.gdc_wait(PDL)
    top = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([DV], dtype=tl.float32)
    for c0 in range(0, NSP, CB):  # constexpr bounds: a power of two >= NS, in blocks of CB
        c = c0 + tl.arange(0, CB)
        live = c < NS
        part = ((b * KV + g) * NS + c) * GP + gi  # [CB]
        mc = tl.load(m_ptr + part, mask=live, other=float("-inf"))
        lc = tl.load(l_ptr + part, mask=live, other=0.0)
        chunk = tl.load(acc_ptr + part[:, None] * DV + dv[None, :], mask=live[:, None], other=0.0)
        new = tl.maximum(top, tl.max(mc, axis=0))
        safe = tl.where(new == float("-inf"), 0.0, new)  # no key seen yet: weights stay 0
        w = tl.exp(mc - safe)  # [CB]
        a_old = tl.exp(top - safe)
        den = den * a_old + tl.sum(w * lc, axis=0)
        acc = acc * a_old + tl.sum(w[:, None] * chunk, axis=0)
        top = new
    row = tl.load(rows_ptr + b)
    y = acc / den
    first = tl.program_id(2) == 0
    tl.store(out_ptr + (row * KV * G + hh) * DV + dv, y, mask=(dv < DV) & first)
    if QUANT:  # the row is KV * G * DV wide; this head holds its groups hh * DV / 32 onwards
        ng = KV * G * (DV // 32)  # groups per row
        grp = hh * (DV // 32) + tl.arange(0, DV // 32)
        q_row, s16_row = q_ptr + row * ng * 8, s16_ptr + row * ng * 2
        yg = tl.reshape(y, (DV // 32, 32))
        gm = (grp < ng) & first
        quant_groups(yg, grp, gm, q_row, d_ptr + row * ng, s16_row, xs_ptr + row * ng, DV // 32, RN)
    if LORA:
        start = lo
        if APF:
            shrink_rows(y, a0, lo + tl.arange(0, BRS), row, hh, lw_ptr, slw, t_ptr, R, PS, PART)
            start = lo + BRS
        for r0 in range(start, tl.minimum(lo + RSTEP, R), BRS):
            r = r0 + tl.arange(0, BRS)
            a = a_rows(a_ptr, r, cols, dv < DV, KV * G * DV, R)
            shrink_rows(y, a, r, row, hh, lw_ptr, slw, t_ptr, R, PS, PART)


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
    bj: int | None = None,
    warps: int | None = None,
    dot: str | None = SPLIT_DOT,
    quant: QuantizedX | None = None,
    kernel: str | None = None,
    tune: dict | None = None,
    shrink=None,
) -> torch.Tensor:
    """`decode_attention` for unquantized caches: q [T, H, D] float32 -> [nd, H, Dv] float32.
    With `out` [T, H, Dv] the results go straight to the plan's rows of it (returned). `bj`
    (keys per step), `warps`, `dot` (the tensor-core split), `kernel` (`SPLIT_KERNEL`) and `tune`
    (the span split's, `triton_split.TUNE`) override the launch (benchmarks).
    `quant`: buffers for the output's rows quantized ([T or nd, H * Dv], `empty_quantized`; Dv a
    multiple of 32), which the combine fills along with the float rows; with `out`, the plan's
    rows must be all of out's (`decode.quantized_output` allocates them). `shrink` (a
    `lora_delta.LoraShrink`, the same rows rule): the output projection's LoRA shrink, which the
    combine adds into that projection's scratch."""
    nd, m = plan.slots.shape
    _, _, kvh, d = k_cache.shape
    dv = v_cache.shape[-1]
    h = q.shape[1]
    if quant is not None:  # every row quantized: rows the plan skips would hold garbage
        t = nd if out is None else out.shape[0]
        if t != nd or dv % 32 or quant.scale.shape != (t, h * dv // 32):
            raise ValueError(f"quant needs all {t} rows in the plan ({nd}) and Dv % 32 == 0")
    if shrink is not None and out is not None and out.shape[0] != nd:
        raise ValueError(f"a LoRA shrink needs all {out.shape[0]} rows in the plan ({nd})")
    g = h // kvh
    gp = triton.next_power_of_2(g)
    launch = pdl.launch_options(pdl.enabled(q))
    if dot is not None and dot not in ("exact", "native"):
        raise ValueError(f"dot must be None, 'exact' or 'native', not {dot!r}")
    if (kernel or SPLIT_KERNEL) == "span" and dot is not None and min(d, dv) >= 16:
        tune = (tune or {}) | {"bj": bj, "warps": warps}
        mx, den, acc, ns = split_span(q, k_cache, v_cache, plan, scale, softcap, dot, launch, tune)
        return _combine(q, mx, den, acc, ns, plan, out, quant, g, kvh, dv, launch, shrink)
    step = 16
    ns = max(1, min(triton.cdiv(m, step), triton.cdiv(PROGRAM_TARGET, nd * kvh)))
    chunk = max(step, triton.next_power_of_2(triton.cdiv(m, ns)))
    ns = triton.cdiv(m, chunk)
    fit = max(1, PRODUCT_VALUES // (gp * max(d, dv)))
    if bj is None:  # a power of two within the register budget
        bj = max(step, min(chunk, 1 << (fit.bit_length() - 1)))
    bj = min(bj, chunk)
    dev = q.device
    mx = torch.empty(nd * kvh * ns * gp, dtype=torch.float32, device=dev)
    den = torch.empty_like(mx)
    acc = torch.empty(nd * kvh * ns * gp, dv, dtype=torch.float32, device=dev)
    pad = plan.pad.reshape(nd, m) if plan.pad is not None else plan.slots
    slots = plan.slots.contiguous()
    qc = q.contiguous()
    args = (qc, plan.rows, k_cache, v_cache, slots, pad.contiguous(), mx, den, acc, m, ns, scale)
    geo = {"CHUNK": chunk, "KV": kvh, "G": g, "GP": gp, "D": d, "DV": dv, "BJ": bj}
    flags = {"HAS_PAD": plan.pad is not None, "CAP": softcap is not None, "num_warps": warps or 4}
    flags |= launch
    if dot is not None and min(d, dv) >= 16:  # tl.dot needs 16-wide operands
        dot_geo = {"GH": max(16, gp), "EXACT": dot == "exact"}
        _split_dot_kernel[(nd, kvh, ns)](*args, softcap or 0.0, **geo, **dot_geo, **flags)
    else:
        _split_kernel[(nd, kvh, ns)](*args, softcap or 0.0, **geo, **flags)
    return _combine(q, mx, den, acc, ns, plan, out, quant, g, kvh, dv, launch, shrink)


def _combine(q, mx, den, acc, ns, plan, out, quant, g, kvh, dv, launch, shrink=None):
    """The combine launch over a split's partials (into `out`'s plan rows, or a new [nd, H, Dv]);
    `shrink`: the output projection's LoRA shrink, added into its scratch."""
    nd, gp, dev = plan.rows.shape[0], triton.next_power_of_2(g), q.device
    if out is None:
        out = torch.empty(nd, kvh * g, dv, dtype=torch.float32, device=dev)
        rows = torch.arange(nd, device=dev)
    else:
        rows = plan.rows
    qa = (out,) * 4 if quant is None else (quant.words, quant.scale, quant.sum16, quant.xsum)
    nsp = triton.next_power_of_2(ns)
    cb = min(nsp, max(1, COMBINE_VALUES // dv))
    after = None  # a shrink whose partials (one a head) would not fit: its torch form after
    if shrink is not None and shrink.ps and kvh * g > shrink.ps:
        shrink, after = None, shrink
    r = 0 if shrink is None else shrink.a.shape[0]
    rstep = COMBINE_LORA_RSTEP if r and COMBINE_LORA_RSTEP else max(r, 1)
    grid = (nd, kvh * g, triton.cdiv(max(r, 1), rstep))
    ps = 0 if shrink is None else shrink.ps
    geo = {"KV": kvh, "G": g, "GP": gp, "DV": dv, "CB": cb, "NSP": nsp}
    geo |= {"QUANT": quant is not None, "RN": q.is_cuda, "LORA": shrink is not None, "PART": ps > 0,
            "APF": COMBINE_LORA_PREFETCH}  # fmt: skip
    if shrink is None:
        la = (out, out, out, 0, 0)
    else:
        if shrink.a.shape[1] != kvh * g * dv or shrink.w.stride(1) != 1:
            raise ValueError(f"LoRA shrink A {tuple(shrink.a.shape)} for {kvh * g} x {dv}")
        la = (shrink.a, shrink.w, shrink.t, shrink.w.stride(0), shrink.a.shape[0])
    _combine_kernel[grid](
        mx, den, acc, rows, out, *qa, *la[:3], ns, *la[3:], rstep, ps, **geo, **launch,
        num_warps=COMBINE_WARPS,
    )  # fmt: skip
    if shrink is not None:
        shrink.wrote(kvh * g)
    if after is not None:
        after.reference(out.reshape(out.shape[0], -1))
    return out
