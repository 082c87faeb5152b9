"""Decode routing on CUDA: the float32 router GEMV (one program per expert row) and top-k +
softmax per token (k rounds of max over the row's logits), in one launch: the program that
finishes its row last (an atomic counter per MoE block) routes every token. Without a counter
(or with `FUSED_ROUTE` off) it is two launches, the GEMV then one top-k program per token.

Eager torch spends ~6 launches per layer here (cuBLAS GEMV, a top-k that sorts, softmax, copies):
~20 us of a ~130 us MoE decode layer on an H200. Same results as `routing.route_topk` on the same
logits (float32 sums in another order: logits agree to rounding), the lowest expert index winning an
exact tie. Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests).
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl

ROUTE_MAX_T = 8  # tokens per call of the router GEMV (decode); prompts take torch's GEMM
# Warps of a top-k program: its 2k + 2 reductions over one row of logits stay within a warp
# (shuffles) instead of crossing warps through shared memory with a barrier each
TOPK_WARPS = 1
# Decode routing in one launch where the caller holds a counter (an A/B switch for tests/perf)
FUSED_ROUTE = True
# Warps of a router row's program, both paths: one keeps the fused kernel's top-k in shuffles too,
# and equal warps (TOPK_WARPS included) give both paths the same layouts, so the same bits
ROUTE_WARPS = 1


@triton.jit
def _router_row(x_ptr, w_ptr, e, T, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Expert e's logits [BT] for the T tokens x [T, K] (float32 sums; 0 past T)."""
    t = tl.arange(0, BT)
    tm = t < T
    acc = tl.zeros([BT, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        w = tl.load(w_ptr + e * K + kk, mask=km, other=0.0)
        xm = tm[:, None] & km[None, :]
        xv = tl.load(x_ptr + t[:, None] * K + kk[None, :], mask=xm, other=0.0)
        acc += xv * w[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _topk_row(v, E, KSEL: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr):
    """One token's logits v [BE] (-inf past E) -> (weights [KP], ids [KP] int64; first KSEL)."""
    idx = tl.arange(0, BE)
    mx = tl.max(v, axis=0)
    total = tl.sum(tl.where(idx < E, tl.exp(v - mx), 0.0), axis=0)
    j = tl.arange(0, KP)
    top = tl.full([KP], -float("inf"), tl.float32)
    ids = tl.zeros([KP], dtype=tl.int64)
    for r in tl.static_range(KSEL):
        best = tl.max(v, axis=0)
        at = tl.min(tl.where(v == best, idx, BE), axis=0)  # lowest index among equals
        top = tl.where(j == r, best, top)
        ids = tl.where(j == r, at.to(tl.int64), ids)
        v = tl.where(idx == at, -float("inf"), v)
    if NORM:  # softmax over the k chosen = renormalised top-k probabilities
        p = tl.exp(top - tl.max(top, axis=0))
        w = p / tl.sum(tl.where(j < KSEL, p, 0.0), axis=0)
    else:
        w = tl.exp(top - mx) / total
    return w, ids


@triton.jit
def _router_logits(
    x_ptr, w_ptr, out_ptr, T, E, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    KL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    pdl.gdc_begin(PDL)
    lines = tl.arange(0, KL) * 32  # the expert's router row, one request per 128-byte line
    pdl.prefetch_l2(w_ptr + e * K + lines, lines < K, PDL)
    pdl.gdc_wait(PDL)
    t = tl.arange(0, BT)
    tl.store(out_ptr + t * E + e, _router_row(x_ptr, w_ptr, e, T, K, BT, BK), mask=t < T)


@triton.jit
def _topk_softmax(
    logits_ptr, w_ptr, id_ptr, E, KSEL: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    t = tl.program_id(0)
    idx = tl.arange(0, BE)
    v = tl.load(logits_ptr + t * E + idx, mask=idx < E, other=-float("inf"))
    w, ids = _topk_row(v, E, KSEL, KP, BE, NORM)
    j = tl.arange(0, KP)
    tl.store(w_ptr + t * KSEL + j, w, mask=j < KSEL)
    tl.store(id_ptr + t * KSEL + j, ids, mask=j < KSEL)


@triton.jit
def _route_fused(
    x_ptr, w_ptr, logits_ptr, wt_ptr, id_ptr, cnt_ptr, T, E, K: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, KL: tl.constexpr, KSEL: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`_router_logits`, then the program that finishes its row last does `_topk_softmax` for
    every token and resets the counter for the next launch (CUDA-graph replays included)."""
    e = tl.program_id(0)
    pdl.gdc_begin(PDL)
    lines = tl.arange(0, KL) * 32
    pdl.prefetch_l2(w_ptr + e * K + lines, lines < K, PDL)
    pdl.gdc_wait(PDL)
    t = tl.arange(0, BT)
    tl.store(logits_ptr + t * E + e, _router_row(x_ptr, w_ptr, e, T, K, BT, BK), mask=t < T)
    tl.debug_barrier()  # every thread's logits are written before the counter moves
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if done == E - 1:
        idx = tl.arange(0, BE)
        j = tl.arange(0, KP)
        for tok in range(0, BT):  # BT rounds, not T: the interpreter warns on a runtime bound
            if tok < T:  # L1 is not coherent across SMs: read the logits from L2
                row = logits_ptr + tok * E + idx
                v = tl.load(row, mask=idx < E, other=-float("inf"), cache_modifier=".cg")
                w, ids = _topk_row(v, E, KSEL, KP, BE, NORM)
                tl.store(wt_ptr + tok * KSEL + j, w, mask=j < KSEL)
                tl.store(id_ptr + tok * KSEL + j, ids, mask=j < KSEL)
        tl.atomic_xchg(cnt_ptr, 0)


def route_counter(device: torch.device | str) -> torch.Tensor:
    """A counter for `route_topk_cuda`'s one launch: zero, and zero again after every launch.
    One per caller whose launches may overlap (an MoE block's are stream-ordered)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_topk_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    k: int,
    norm_topk_prob: bool,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (T <= ROUTE_MAX_T), router weight w float32 [E, D] -> (weights [T, k] float32,
    ids [T, k] int64), as `route_topk(x @ w.T, k, norm_topk_prob)`. With a `route_counter` on
    x's device: one launch (bit for bit the two launches' results), else two."""
    t, d = x.shape
    e = w.shape[0]
    x = x.float().contiguous()
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    bt = triton.next_power_of_2(max(t, 1))
    bk = min(512 // bt, triton.next_power_of_2(d))
    kl = triton.next_power_of_2(triton.cdiv(d, 32))
    geo = {"K": d, "BT": bt, "BK": bk, "KL": kl, **pdl.launch_options(pdl.enabled(x))}
    if counter is None or not FUSED_ROUTE:
        _router_logits[(e,)](x, w, logits, t, e, num_warps=ROUTE_WARPS, **geo)
        return topk_softmax_cuda(logits, k, norm_topk_prob)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    sel = {"KSEL": k, "KP": triton.next_power_of_2(k), "BE": triton.next_power_of_2(e)}
    args = (x, w, logits, weights, ids, counter, t, e)
    _route_fused[(e,)](*args, NORM=norm_topk_prob, num_warps=ROUTE_WARPS, **geo, **sel)
    return weights, ids


def topk_softmax_cuda(
    logits: torch.Tensor, k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` of float32 logits [T, E] in one launch (any T: prompts take torch's router
    GEMM, then this in place of a sorting top-k, a softmax and copies)."""
    t, e = logits.shape
    logits = logits.float().contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    be, kp = triton.next_power_of_2(e), triton.next_power_of_2(k)
    geo = {"KSEL": k, "KP": kp, "BE": be, "NORM": norm_topk_prob}
    launch = {"num_warps": TOPK_WARPS, **pdl.launch_options(pdl.enabled(logits))}
    _topk_softmax[(t,)](logits, weights, ids, e, **geo, **launch)
    return weights, ids
