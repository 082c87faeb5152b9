"""Decode routing on CUDA in two launches: the float32 router GEMV (one program per expert row)
and top-k + softmax per token (k rounds of max over the row's logits); DeepSeek-style scored
routing without groups (sigmoid or softmax scores, a choice bias, a weight scale) likewise.

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
    tm = t < T
    acc = tl.zeros([BT, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        w = tl.load(w_ptr + e * K + kk, mask=km, other=0.0)
        xm = tm[:, None] & km[None, :]
        xv = tl.load(x_ptr + t[:, None] * K + kk[None, :], mask=xm, other=0.0)
        acc += xv * w[None, :]
    tl.store(out_ptr + t * E + e, tl.sum(acc, axis=1), mask=tm)


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
    tl.store(w_ptr + t * KSEL + j, w, mask=j < KSEL)
    tl.store(id_ptr + t * KSEL + j, ids, mask=j < KSEL)


@triton.jit
def _topk_scored(
    logits_ptr, bias_ptr, w_ptr, id_ptr, E, scale, KSEL: tl.constexpr, KP: tl.constexpr,
    BE: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """`routing.route_scored` of one row without expert groups: softmax or sigmoid scores, the
    choice shifted by a bias, the chosen scores (unbiased) renormalised or not, times scale."""
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    t = tl.program_id(0)
    idx = tl.arange(0, BE)
    m = idx < E
    v = tl.load(logits_ptr + t * E + idx, mask=m, other=0.0)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-v))
    else:
        ex = tl.where(m, tl.exp(v - tl.max(tl.where(m, v, -float("inf")), axis=0)), 0.0)
        s = ex / tl.sum(ex, axis=0)
    c = s
    if BIAS:
        c = s + tl.load(bias_ptr + idx, mask=m, other=0.0)
    c = tl.where(m, c, -float("inf"))
    j = tl.arange(0, KP)
    top = tl.zeros([KP], dtype=tl.float32)
    ids = tl.zeros([KP], dtype=tl.int64)
    for r in tl.static_range(KSEL):
        best = tl.max(c, axis=0)
        at = tl.min(tl.where(c == best, idx, BE), axis=0)  # lowest index among equals
        top = tl.where(j == r, tl.sum(tl.where(idx == at, s, 0.0), axis=0), top)
        ids = tl.where(j == r, at.to(tl.int64), ids)
        c = tl.where(idx == at, -float("inf"), c)
    if NORM:
        top = top / tl.sum(tl.where(j < KSEL, top, 0.0), axis=0)
    tl.store(w_ptr + t * KSEL + j, top * scale, mask=j < KSEL)
    tl.store(id_ptr + t * KSEL + j, ids, mask=j < KSEL)


def route_topk_cuda(
    x: torch.Tensor, w: torch.Tensor, k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (T <= ROUTE_MAX_T), router weight w float32 [E, D] -> (weights [T, k] float32,
    ids [T, k] int64), as `route_topk(x @ w.T, k, norm_topk_prob)`."""
    return topk_softmax_cuda(router_logits_cuda(x, w), k, norm_topk_prob)


def router_logits_cuda(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] (T <= ROUTE_MAX_T) @ w.T in float32 (w [E, D] float32): one program an expert."""
    t, d = x.shape
    e = w.shape[0]
    x = x.float().contiguous()
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    bt = triton.next_power_of_2(max(t, 1))
    bk = min(512 // bt, triton.next_power_of_2(d))
    kl = triton.next_power_of_2(triton.cdiv(d, 32))
    geo = {"K": d, "BT": bt, "BK": bk, "KL": kl, **pdl.launch_options(pdl.enabled(x))}
    _router_logits[(e,)](x, w, logits, t, e, num_warps=2, **geo)
    return logits


def topk_scored_cuda(
    logits: torch.Tensor, k: int, scoring: str, bias: torch.Tensor | None, norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`routing.route_scored` of float32 logits [T, E] without expert groups (GLM-4.5's,
    LFM2-MoE's sigmoid scores with a choice bias) in one launch, in place of ~8 torch ops."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"router scores {scoring!r}: softmax or sigmoid")
    t, e = logits.shape
    logits = logits.float().contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    b = logits if bias is None else bias.float().contiguous()
    geo = {"KSEL": k, "KP": triton.next_power_of_2(k), "BE": triton.next_power_of_2(e),
           "SIGMOID": scoring == "sigmoid", "BIAS": bias is not None, "NORM": norm}  # fmt: skip
    launch = {"num_warps": TOPK_WARPS, **pdl.launch_options(pdl.enabled(logits))}
    _topk_scored[(t,)](logits, b, weights, ids, e, float(scale), **geo, **launch)
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
