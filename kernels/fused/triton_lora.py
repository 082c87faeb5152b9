"""Triton kernels of `lora_delta`: a (fused) linear's LoRA delta for a few rows in two short
launches, whatever the number of adapters and output parts (CUDA; or CPU tensors under
TRITON_INTERPRET=1).

At decode both kernels are latency-bound (the adapters are ~2 % of the base's bytes), so each
program does one tile and no loop of dependent loads:

- `_shrink`: programs over (BK columns of `in`, BR rows of the stacked A) compute their slice of
  x @ A_all.T, scale it by W (row t's factor per column) and add it with float32 atomics into a
  per-module scratch t [rows, R] that the previous call left at zero.
- `_expand`: programs over (block of output columns, part) read their part's columns of t once
  and add t @ B.T into that part's output in place; the last program to finish (an atomic
  counter) zeroes t and the counter for the next call, so no memset launch is needed.

One row (single-stream decode) runs broadcast products instead of `tl.dot` (whose tiles pad the
rows to 16). Float32 math on float16/float32 weights, as the reference (tl.dot in "tf32x3":
three TF32 tensor-core products, float32-accurate; "ieee" FMA tiles spilled kilobytes); the
atomics' order makes t's last bit vary run to run (a row on no adapter still adds exactly 0).
The first scheme (looped split-K partials) was removed after its A/B (tests/perf/results/lora.md).
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.fused.lora_delta import KERNEL_ROWS, LoraPart

MAX_ROWS = KERNEL_ROWS  # token rows the kernels take (decode steps); more: the torch path
MAX_PARTS = 3  # output parts one expand launch writes (q, k, v)
MAX_RANK = 256  # columns of one part (the sum of its adapters' ranks) one program holds
BK = 128  # columns of `in` per shrink program (K=4096: 32 programs per block of A's rows)
ZR = 64  # columns of t the resetting program zeroes per store


def usable(x: torch.Tensor, parts: list[LoraPart], ys: list[torch.Tensor]) -> bool:
    """Whether the kernels take this call (else the caller runs the reference)."""
    return (
        0 < x.shape[0] <= MAX_ROWS
        and 0 < len(parts) <= MAX_PARTS
        and x.stride(-1) == 1
        and all(y.stride(-1) == 1 and y.dtype == ys[0].dtype for y in ys)
        and all(p.b_t.dtype == parts[0].b_t.dtype and p.hi - p.lo <= MAX_RANK for p in parts)
    )


@triton.jit
def _shrink(x_ptr, sx, a_ptr, w_ptr, sw, t_ptr, T, K, R, BT: tl.constexpr, BR: tl.constexpr,
            BK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    km = k < K
    rm = r < R
    pdl.gdc_begin(PDL)
    # A is a weight: read before waiting for the kernel that made x
    am = rm[:, None] & km[None, :]
    a = tl.load(a_ptr + r[:, None].to(tl.int64) * K + k[None, :], mask=am, other=0.0)
    a = a.to(tl.float32)
    pdl.gdc_wait(PDL)
    rows = tl.arange(0, BT)
    tm = rows < T
    xb = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    if DOT:
        acc = tl.dot(xb, tl.trans(a), input_precision="tf32x3")
    else:  # one row: [1, BR, BK] products, no padding to 16 rows
        acc = tl.sum(xb[:, None, :] * a[None, :, :], axis=2)
    m = tm[:, None] & rm[None, :]
    acc *= tl.load(w_ptr + rows[:, None] * sw + r[None, :], mask=m, other=0.0)
    tl.atomic_add(t_ptr + rows[:, None] * R + r[None, :], acc, mask=m, sem="relaxed")


@triton.jit
def _expand(t_ptr, cnt_ptr, T, R,
            y0, y1, y2, b0, b1, b2, sy0, sy1, sy2, n0, n1, n2, lo0, lo1, lo2, r0, r1, r2,
            BT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
            ZR: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
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
    bt = tl.load(b + rr[:, None] * n + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
    bt = bt.to(tl.float32)
    pdl.gdc_wait(PDL)
    rows = tl.arange(0, BT)
    tm = rows < T
    # t was summed by the shrink's atomics in L2: read it there (no L1 line of an earlier call)
    t = tl.load(t_ptr + rows[:, None] * R + (lo + rr)[None, :], mask=tm[:, None] & rm[None, :],
                other=0.0, cache_modifier=".cg")  # fmt: skip
    if DOT:
        d = tl.dot(t, bt, input_precision="tf32x3")
    else:
        d = tl.sum(t[:, :, None] * bt[None, :, :], axis=1)
    ym = tm[:, None] & cm[None, :]
    yp = y + rows[:, None] * sy + cols[None, :]
    old = tl.load(yp, mask=ym, other=0.0)
    tl.store(yp, (old.to(tl.float32) + d).to(old.dtype), mask=ym)
    # every thread's reads of t are done before this program counts itself finished
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last one: reset for next call
        for c0 in range(0, R, ZR):
            zc = c0 + tl.arange(0, ZR)
            zm = tm[:, None] & (zc < R)[None, :]
            tl.store(t_ptr + rows[:, None] * R + zc[None, :], tl.zeros((BT, ZR), tl.float32),
                     mask=zm)  # fmt: skip
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")


def _rows(t: int) -> tuple[int, bool]:
    """(row tile, whether tl.dot runs): one row alone, else a tl.dot tile of at least 16."""
    return (1, False) if t == 1 else (max(16, triton.next_power_of_2(t)), True)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def shrink(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, scratch: tuple) -> None:
    """scratch t += (x @ a.T) * w in one launch (t zero before; `usable`'s row and stride
    rules): the first half of `shrink_expand`, and all of a LoRA call whose expand runs in the
    base GEMV's epilogue (`kernels.quant.triton_lora_tail`)."""
    t, k = x.shape
    r = a.shape[0]
    acc = scratch[0]
    if acc.shape[1] != r or acc.shape[0] < t:
        raise ValueError(f"LoRA scratch {tuple(acc.shape)} does not fit {t} rows of rank {r}")
    bt, dot = _rows(t)
    br = 64 if r > 32 else _pow2(r)
    _shrink[(triton.cdiv(k, BK), triton.cdiv(r, br))](
        x, x.stride(0), a, w, w.stride(0), acc, t, k, r, BT=bt, BR=br, BK=BK, DOT=dot,
        num_warps=4, **pdl.launch_options(pdl.enabled(x)),
    )  # fmt: skip


def shrink_expand(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, parts: list[LoraPart],
                  ys: list[torch.Tensor], scratch: tuple) -> None:  # fmt: skip
    """`lora_delta.shrink_expand_reference` in two launches (`usable` must hold): ys[p] += part
    p's delta in place. a [R, in] contiguous; w [rows >= T, R] with unit column stride;
    `scratch`: this module's `lora_delta.scratch(R, device)` (zero between calls)."""
    t = x.shape[0]
    r = a.shape[0]
    acc, count = scratch
    shrink(x, a, w, scratch)
    bt, dot = _rows(t)
    on = pdl.enabled(x)
    pad = [*parts, *[parts[0]] * (MAX_PARTS - len(parts))]
    ypad = [*ys, *[ys[0]] * (MAX_PARTS - len(ys))]
    rank = _pow2(max(p.hi - p.lo for p in parts))
    bn = 64 if rank <= 64 else 32
    n_max = max(p.b_t.shape[1] for p in parts)
    _expand[(triton.cdiv(n_max, bn), len(parts))](
        acc, count, t, r,
        *ypad, *(p.b_t for p in pad), *(y.stride(0) for y in ypad),
        *(p.b_t.shape[1] for p in pad), *(p.lo for p in pad), *(p.hi - p.lo for p in pad),
        BT=bt, BR=rank, BN=bn, DOT=dot, ZR=ZR, num_warps=4, **pdl.launch_options(on),
    )  # fmt: skip


@triton.jit
def a_rows(a_ptr, r, cols, cmask, width, R):
    """Rows r of a stacked LoRA A ([R, width] float16) over columns `cols` (cmask), float32;
    rows past R read as zero. A producer kernel's share of a shrink (the SiLU's, the combine's)."""
    return tl.load(a_ptr + r[:, None].to(tl.int64) * width + cols[None, :],
                   mask=(r < R)[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def shrink_rows(y, a, r, row, slot, lw_ptr, slw, t_ptr, R, PS, PART: tl.constexpr):
    """(y @ a.T) * W[row, r] for rows r of a producer's shrink: stored as partial `slot` of t
    (PART, `LoraShrink.ps`; the GEMV epilogue sums them) or added into t with float32 atomics
    (t zero before)."""
    rm = r < R
    acc = tl.sum(y[None, :] * a, axis=1)
    acc *= tl.load(lw_ptr + row * slw + r, mask=rm, other=0.0)
    if PART:
        tl.store(t_ptr + (row * R + r) * PS + slot, acc, mask=rm)
    else:
        tl.atomic_add(t_ptr + row * R + r, acc, mask=rm, sem="relaxed")
