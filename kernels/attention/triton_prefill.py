"""Flash attention for a prompt chunk on CUDA: t new queries of one sequence over its m visible
keys, causal, GQA, with the reference's sliding window, soft-cap, attention sinks and
bidirectional spans (Gemma 3's image tokens: a query inside a span also sees the span's later
keys), in one launch. It replaces `paged._chunk`'s dense path (a boolean mask, SDPA's float32
math path or matmul + softmax + matmul: ~12 kernels and as many host dispatches per layer,
~230 us of device time for a 512-token Qwen3-30B-A3B layer on an H200).

Keys and values come as the reference gathers them: [m, KV, D] views of the cache (zero-copy
when the sequence's blocks are consecutive). Products run on tensor cores, as precise as the
cache's type warrants (`BLOCKS`); the softmax is the online one, in float32. Reference:
`paged._chunk`. Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests).
"""

import torch
import triton
import triton.language as tl

from localllm.kernels.attention.context_heads import context_heads

# Products per cache type: float32 keys get ~float32 products (three tf32 passes); f16/bf16 keys,
# already rounded to 10/7 mantissa bits, get one tf32 pass (q and the softmax weights rounded to
# 10 bits, as llama.cpp's f16 flash attention does). H200, 32 q heads of 128, f16 keys
# (tests/perf/bench_prefill_attention.py): 512 / 2,048 tokens, tf32x3 150 / 1,470 us, tf32 56 /
# 356 us at its best geometry, the float32 SDPA path before 374 / 3,211 us; max error 2e-6 / 2e-3.
# Geometry per precision: (query rows, keys per step, warps).
BLOCKS = {"tf32x3": (32, 32, 4), "tf32": (32, 64, 4)}


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, sinks_ptr, out_ptr, table_ptr, ctx_ptr, span_ptr, T, M, Q0, WINDOW,
    scale, softcap, sq_t, sq_h, sk_m, sk_h, sv_m, sv_h,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, CAP: tl.constexpr, SINKS: tl.constexpr, DOT: tl.constexpr,
    PAGED: tl.constexpr, BS: tl.constexpr, SPANS: tl.constexpr,
):  # fmt: skip
    i0, h = tl.program_id(0) * BM, tl.program_id(1)
    g = h // G
    if PAGED:  # the context on the device: first new key index, keys after the step
        Q0 = tl.load(ctx_ptr)
        M = tl.load(ctx_ptr + 1)
    i = i0 + tl.arange(0, BM)
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    pos = Q0 + i  # each query's own key index: it sees keys <= pos (and > pos - WINDOW)
    q = tl.load(q_ptr + i[:, None] * sq_t + h * sq_h + d[None, :], mask=(i < T)[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    mx = tl.full([BM], float("-inf"), tl.float32)
    den = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DV], dtype=tl.float32)
    hi = tl.minimum(M, Q0 + i0 + BM)  # past the last key the tile's last query sees
    if SPANS:  # per query [lo, hi) of keys it also sees (its span; empty outside one)
        s_lo = tl.load(span_ptr + 2 * i, mask=i < T, other=0)
        s_hi = tl.load(span_ptr + 2 * i + 1, mask=i < T, other=0)
        hi = tl.minimum(M, tl.maximum(hi, tl.max(s_hi, axis=0)))
    lo = 0
    if HAS_WINDOW:  # the first key the tile's first query sees, down to a whole step
        lo = tl.maximum(Q0 + i0 - WINDOW + 1, 0) // BN * BN
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < M
        if PAGED:  # key j sits in block table[j // BS], row j % BS
            r = tl.load(table_ptr + j // BS, mask=jm, other=0) * BS + j % BS
        else:
            r = j
        k = tl.load(k_ptr + r[:, None] * sk_m + g * sk_h + d[None, :], mask=jm[:, None], other=0.0)
        v = tl.load(v_ptr + r[:, None] * sv_m + g * sv_h + dv[None, :], mask=jm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT)  # [BM, BN]
        if CAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / cap)
        ok = j[None, :] <= pos[:, None]
        if SPANS:
            ok |= (j[None, :] >= s_lo[:, None]) & (j[None, :] < s_hi[:, None])
        ok &= jm[None, :]
        if HAS_WINDOW:
            ok &= j[None, :] > pos[:, None] - WINDOW
        s = tl.where(ok, s, float("-inf"))
        new = tl.maximum(mx, tl.max(s, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)  # a row with no key yet: weights stay 0
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(mx - safe)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT)
        den = den * alpha + tl.sum(p, axis=1)
        mx = new
    if SINKS:  # a virtual key with a zero value: it joins the denominator only
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(mx, sink)
        a = tl.exp(mx - top)
        acc, den = acc * a[:, None], den * a + tl.exp(sink - top)
    out = out_ptr + (i[:, None] * tl.num_programs(1) + h) * DV + dv[None, :]  # [T, H, DV]
    tl.store(out, acc / den[:, None], mask=(i < T)[:, None])


def supports(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> bool:
    """Chunks the kernel takes: float32 queries on CUDA, float keys, power-of-two head dims
    of at least 16 (tensor-core tiles)."""
    d, dv = keys.shape[-1], vals.shape[-1]
    return (
        q.is_cuda
        and q.dtype == torch.float32
        and keys.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and context_heads(d, dv)
    )


def flash_prefill(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    q0: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block: tuple[int, int, int] | None = None,
    dot: str | None = None,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """`paged._chunk`: t queries q [t, H, D] at key indices q0..q0+t-1 over keys/vals [m, KV, D]
    (row strides free, last dim contiguous) -> float32 [t, H, Dv]. `dot` (the products'
    precision, "tf32x3" or "tf32") and `block` (query rows, keys per step, warps) default by the
    keys' type (`BLOCKS`). `spans`: key-index ranges [a, b) within the keys whose queries see
    all of them (`paged.chunk_dense`'s)."""
    t, h, d = q.shape
    m, kvh, _ = keys.shape
    dv = vals.shape[-1]
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or vals.stride(-1) != 1:
        raise ValueError("flash_prefill needs the head dims contiguous")
    dot = dot or ("tf32x3" if keys.dtype == torch.float32 else "tf32")
    bm, bn, warps = block or BLOCKS[dot]
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    sk = sinks if sinks is not None else out  # unread without SINKS
    rows = span_rows(spans, q0, t, q.device) if spans else out  # unread without SPANS
    _prefill_kernel[(triton.cdiv(t, bm), h)](
        q, keys, vals, sk, out, out, out, rows, t, m, q0, window or 0, scale, softcap or 0.0,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), vals.stride(0), vals.stride(1),
        G=h // kvh, D=d, DV=dv, BM=bm, BN=bn, HAS_WINDOW=bool(window), CAP=softcap is not None,
        SINKS=sinks is not None, DOT=dot, PAGED=False, BS=1, SPANS=bool(spans), num_warps=warps,
    )  # fmt: skip
    return out


def span_rows(spans: list[tuple[int, int]], q0: int, t: int, device) -> torch.Tensor:
    """[t, 2] int32: each query's span [a, b) in key indices, (0, 0) outside every span."""
    rows = torch.zeros(t, 2, dtype=torch.int32)
    for a, b in spans:
        lo, hi = max(a - q0, 0), min(b - q0, t)
        if lo < hi:
            rows[lo:hi, 0], rows[lo:hi, 1] = a, b
    return rows.to(device)


def flash_prefill_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`flash_prefill` for one sequence whose context lives on the device: `ctx` [2] int64 (the
    first new token's key index, the keys after the step) and its block `table` [W] int64 over
    caches [blocks, BS, KV, D] (keys read in place, as stored). q [t, H, D] holds the new tokens;
    rows past ctx[1] - ctx[0] are padding (computed, never meant to be read). No host value
    depends on the context, so a graph captured once replays for any."""
    t, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    dv = v_cache.shape[-1]
    keys, vals = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or vals.stride(-1) != 1:
        raise ValueError("flash_prefill_paged needs the head dims contiguous")
    dot = "tf32x3" if keys.dtype == torch.float32 else "tf32"
    bm, bn, warps = BLOCKS[dot]
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    sk = sinks if sinks is not None else out  # unread without SINKS
    _prefill_kernel[(triton.cdiv(t, bm), h)](
        q, keys, vals, sk, out, table, ctx, out, t, 0, 0, window or 0, scale, softcap or 0.0,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), vals.stride(0), vals.stride(1),
        G=h // kvh, D=d, DV=dv, BM=bm, BN=bn, HAS_WINDOW=bool(window), CAP=softcap is not None,
        SINKS=sinks is not None, DOT=dot, PAGED=True, BS=bs, SPANS=False, num_warps=warps,
    )  # fmt: skip
    return out
