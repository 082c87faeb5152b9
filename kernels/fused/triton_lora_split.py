"""The first LoRA kernels (kept as an A/B baseline: `engine.lora.delta.SCHEME = "split"`): a
(fused) linear's delta for a few rows in two launches, whatever the number of adapters and parts.

`_shrink`: programs over (slice of `in`, block of the stacked A's rows) write partial sums
[splits, T, R] of x @ A_all.T (no atomics: nothing to zero first), each looping over its 512
columns; `_expand`: programs over (block of output columns, part) sum the partials of their
part's columns in a loop, scale them by W and add t @ B.T into that part's output in place.
Both loops are chains of dependent loads: latency-bound at decode (`triton_lora` replaces them).
Float32 math on float16/float32 weights, as the reference.
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.fused.lora_delta import LoraPart
from localllm.kernels.fused.triton_lora import MAX_PARTS

BK = 64  # columns of `in` per shrink step
SPLIT = 512  # columns of `in` per shrink program


@triton.jit
def _shrink(x_ptr, sx, a_ptr, p_ptr, T, K, R, BT: tl.constexpr, BR: tl.constexpr,
            BK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    s = tl.program_id(0)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    rm = r < R
    rows = tl.arange(0, BT)
    tm = rows < T
    pdl.gdc_begin(PDL)
    k0 = s * SPLIT
    kk = tl.arange(0, BK)
    # the first A block is a weight: read before waiting for the kernel that made x
    am = rm[:, None] & ((k0 + kk) < K)[None, :]
    a = tl.load(a_ptr + r[:, None].to(tl.int64) * K + (k0 + kk)[None, :], mask=am, other=0.0)
    pdl.gdc_wait(PDL)
    acc = tl.zeros((BT, BR), dtype=tl.float32)
    for j in range(0, SPLIT, BK):
        k = k0 + j + kk
        km = k < K
        xb = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :],
                     other=0.0)  # fmt: skip
        if j > 0:
            am = rm[:, None] & km[None, :]
            a = tl.load(a_ptr + r[:, None].to(tl.int64) * K + k[None, :], mask=am, other=0.0)
        acc += tl.dot(xb.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    out = p_ptr + (s * T + rows[:, None]) * R + r[None, :]
    tl.store(out, acc, mask=tm[:, None] & rm[None, :])


@triton.jit
def _expand(p_ptr, splits, w_ptr, sw, T, R,
            y0, y1, y2, b0, b1, b2, sy0, sy1, sy2, n0, n1, n2, lo0, lo1, lo2, r0, r1, r2,
            BT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    part = tl.program_id(1)
    # pointers of one type per name across the branches; the integers chosen arithmetically
    if part == 0:
        y, b = y0, b0
    elif part == 1:
        y, b = y1, b1
    else:
        y, b = y2, b2
    sy = tl.where(part == 0, sy0, tl.where(part == 1, sy1, sy2))
    n = tl.where(part == 0, n0, tl.where(part == 1, n1, n2))
    lo = tl.where(part == 0, lo0, tl.where(part == 1, lo1, lo2))
    rank = tl.where(part == 0, r0, tl.where(part == 1, r1, r2))
    pdl.gdc_begin(PDL)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    cm = cols < n
    rr = tl.arange(0, BR)
    rm = rr < rank
    bm = rm[:, None] & cm[None, :]
    bt = tl.load(b + rr[:, None] * n + cols[None, :], mask=bm, other=0.0).to(tl.float32)
    pdl.gdc_wait(PDL)
    rows = tl.arange(0, BT)
    tm = rows < T
    tmask = tm[:, None] & rm[None, :]
    t = tl.zeros((BT, BR), dtype=tl.float32)
    for s in range(splits):
        t += tl.load(p_ptr + (s * T + rows[:, None]) * R + (lo + rr)[None, :], mask=tmask,
                     other=0.0)  # fmt: skip
    t *= tl.load(w_ptr + rows[:, None] * sw + (lo + rr)[None, :], mask=tmask, other=0.0)
    d = tl.dot(t, bt, input_precision="ieee")
    ym = tm[:, None] & cm[None, :]
    yp = y + rows[:, None] * sy + cols[None, :]
    old = tl.load(yp, mask=ym, other=0.0)
    tl.store(yp, (old.to(tl.float32) + d).to(old.dtype), mask=ym)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def shrink_expand(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, parts: list[LoraPart],
                  ys: list[torch.Tensor]) -> None:  # fmt: skip
    """`lora_delta.shrink_expand_reference` in two launches (`usable` must hold): ys[p] += part
    p's delta in place. a [R, in] contiguous; w [rows >= T, R] with unit column stride."""
    t, k = x.shape
    r = a.shape[0]
    splits = triton.cdiv(k, SPLIT)
    partial = torch.empty(splits, t, r, dtype=torch.float32, device=x.device)
    bt = _pow2(t)
    on = pdl.enabled(x)
    br = 64 if r > 32 else _pow2(r)
    _shrink[(splits, triton.cdiv(r, br))](
        x, x.stride(0), a, partial, t, k, r, BT=bt, BR=br, BK=BK, SPLIT=SPLIT, num_warps=4,
        **pdl.launch_options(on),
    )  # fmt: skip
    pad = [*parts, *[parts[0]] * (MAX_PARTS - len(parts))]
    ypad = [*ys, *[ys[0]] * (MAX_PARTS - len(ys))]
    rank = _pow2(max(p.hi - p.lo for p in parts))
    bn = 64 if rank <= 64 else 32
    n_max = max(p.b_t.shape[1] for p in parts)
    _expand[(triton.cdiv(n_max, bn), len(parts))](
        partial, splits, w, w.stride(0), t, r,
        *ypad, *(p.b_t for p in pad), *(y.stride(0) for y in ypad),
        *(p.b_t.shape[1] for p in pad), *(p.lo for p in pad), *(p.hi - p.lo for p in pad),
        BT=bt, BR=rank, BN=bn, num_warps=4, **pdl.launch_options(on),
    )  # fmt: skip
