"""A (fused) linear's LoRA delta in ONE launch (`engine.lora.delta.SCHEME = "fused"`): the shrink
and the expand of `triton_lora` as two phases of one persistent kernel with a grid barrier.

Decode's LoRA work is a chain of tiny latency-bound steps, so every launch saved is a few
microseconds a module. G programs (at most one per SM, so all are resident at once: the barrier
cannot starve) first loop over the shrink tiles (BK columns of `in` x BR rows of the stacked A;
each tile, times W, added with float32 atomics into the module's scratch t), then arrive at a
barrier (an atomic counter) and spin until all G have, then loop over the expand tiles (output
columns of a part: y_p += t[:, lo:hi] @ B_p.T in place). The last program to finish zeroes t
and both counters for the next call. PDL: the next kernel may be placed only once every program
has started (so never ahead of one of ours still waiting for an SM).
Under TRITON_INTERPRET=1 programs run one after another: G is 1 there (the barrier passes at
once). Float32 math on float16/bfloat16/float32 weights, as the reference (tl.dot in
"tf32x3", float32-accurate on tensor cores).
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.fused.lora_delta import LoraPart
from localllm.kernels.fused.triton_lora import BK, MAX_PARTS, ZR

MAX_PROGRAMS = 132  # the cap on G: an H100's SMs (co-resident at one program each)


@triton.jit
def _fused(x_ptr, sx, a_ptr, w_ptr, sw, t_ptr, sync_ptr, T, K, R, KS, RB, NB, P,
           y0, y1, y2, b0, b1, b2, sy0, sy1, sy2, n0, n1, n2, lo0, lo1, lo2, r0, r1, r2,
           BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, RANK: tl.constexpr,
           BN: tl.constexpr, DOT: tl.constexpr, ZR: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.num_programs(0)
    pdl.gdc_begin(PDL)
    # A is a weight: this program's first shrink tile heads for L2 before the wait
    r_first = (pid // KS) * BR + tl.arange(0, BR)
    k_lines = (pid % KS) * BK + tl.arange(0, BK // 32) * 32
    first = (r_first < R)[:, None] & (k_lines < K)[None, :] & (pid < KS * RB)
    pdl.prefetch_l2(a_ptr + r_first[:, None].to(tl.int64) * K + k_lines[None, :], first, PDL)
    pdl.gdc_wait(PDL)
    rows = tl.arange(0, BT)
    tm = rows < T
    # phase 1: shrink tiles, added into t
    for item in range(pid, KS * RB, g):
        k = (item % KS) * BK + tl.arange(0, BK)
        r = (item // KS) * BR + tl.arange(0, BR)
        km = k < K
        rm = r < R
        a = tl.load(a_ptr + r[:, None].to(tl.int64) * K + k[None, :],
                    mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)  # fmt: skip
        xb = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        if DOT:
            acc = tl.dot(xb, tl.trans(a), input_precision="tf32x3")
        else:
            acc = tl.sum(xb[:, None, :] * a[None, :, :], axis=2)
        m = tm[:, None] & rm[None, :]
        acc *= tl.load(w_ptr + rows[:, None] * sw + r[None, :], mask=m, other=0.0)
        tl.atomic_add(t_ptr + rows[:, None] * R + r[None, :], acc, mask=m, sem="relaxed")
    # the grid barrier: every program's atomics into t land before any program reads t
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release")
    while tl.atomic_add(sync_ptr, 0, sem="acquire") < g:
        pass
    tl.debug_barrier()
    # phase 2: expand tiles over (part, block of its output columns)
    rr = tl.arange(0, RANK)
    for item in range(pid, P * NB, g):
        part = item // NB
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
        cols = (item % NB) * BN + tl.arange(0, BN)
        cm = cols < n
        rm = rr < rank
        bt = tl.load(b + rr[:, None] * n + cols[None, :], mask=rm[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        # t was written by other SMs' atomics: read it from L2, not a stale L1 line
        t = tl.load(t_ptr + rows[:, None] * R + (lo + rr)[None, :],
                    mask=tm[:, None] & rm[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        if DOT:
            d = tl.dot(t, bt, input_precision="tf32x3")
        else:
            d = tl.sum(t[:, :, None] * bt[None, :, :], axis=1)
        ym = tm[:, None] & cm[None, :]
        yp = y + rows[:, None] * sy + cols[None, :]
        old = tl.load(yp, mask=ym, other=0.0)
        tl.store(yp, (old.to(tl.float32) + d).to(old.dtype), mask=ym)
    # the last program out (all have left the spin and read t) resets the scratch
    tl.debug_barrier()
    done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if done == g - 1:
        for c0 in range(0, R, ZR):
            zc = c0 + tl.arange(0, ZR)
            zm = tm[:, None] & (zc < R)[None, :]
            tl.store(t_ptr + rows[:, None] * R + zc[None, :], tl.zeros((BT, ZR), tl.float32),
                     mask=zm)  # fmt: skip
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")


def _programs(x: torch.Tensor, work: int) -> int:
    if not x.is_cuda:
        return 1  # the interpreter runs programs in turn: one, or the barrier never opens
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(work, sms, MAX_PROGRAMS))


def shrink_expand(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, parts: list[LoraPart],
                  ys: list[torch.Tensor], scratch: tuple) -> None:  # fmt: skip
    """`lora_delta.shrink_expand_reference` in one launch (`triton_lora.usable` must hold):
    ys[p] += part p's delta in place; `scratch`: this module's `lora_delta.scratch` (zero)."""
    t, k = x.shape
    r = a.shape[0]
    acc, sync = scratch
    if acc.shape[1] != r or acc.shape[0] < t or sync.numel() < 2:
        raise ValueError(f"LoRA scratch {tuple(acc.shape)} does not fit {t} rows of rank {r}")
    bt, dot = (1, False) if t == 1 else (max(16, triton.next_power_of_2(t)), True)
    br = 64 if r > 32 else max(16, triton.next_power_of_2(r))
    rank = max(16, triton.next_power_of_2(max(p.hi - p.lo for p in parts)))
    bn = 128 if rank <= 32 else 64 if rank <= 64 else 32
    ks, rb = triton.cdiv(k, BK), triton.cdiv(r, br)
    nb = triton.cdiv(max(p.b_t.shape[1] for p in parts), bn)
    g = _programs(x, max(ks * rb, nb * len(parts)))
    pad = [*parts, *[parts[0]] * (MAX_PARTS - len(parts))]
    ypad = [*ys, *[ys[0]] * (MAX_PARTS - len(ys))]
    _fused[(g,)](
        x, x.stride(0), a, w, w.stride(0), acc, sync, t, k, r, ks, rb, nb, len(parts),
        *ypad, *(p.b_t for p in pad), *(y.stride(0) for y in ypad),
        *(p.b_t.shape[1] for p in pad), *(p.lo for p in pad), *(p.hi - p.lo for p in pad),
        BT=bt, BR=br, BK=BK, RANK=rank, BN=bn, DOT=dot, ZR=ZR, num_warps=4,
        **pdl.launch_options(pdl.enabled(x)),
    )  # fmt: skip
