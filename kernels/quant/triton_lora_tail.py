"""The LoRA expand as an optional epilogue of the packed dp4a GEMVs (`engine.lora.delta.SCHEME =
"epilogue"`): the program that finishes an output tile adds t @ B.T for its columns before it
stores them, so a LoRA call site costs the shrink's launch and no expand launch (and no second
read and write of y). With LS ("inline") the GEMV does the shrink too: its programs take
tickets as they start, the first ones do the shrink's items (`lora_shrink_item`) before their
GEMV work, and the tile finishers wait for all items (`lora_wait`). Host side: `tail_args`; the
layout is `lora_delta.LoraTail`, its torch form `lora_delta.tail_reference`.

At decode the expand is a few tiny latency-bound loads (t from L2, a [rank, BN] slice of B), so
the epilogue issues them before the GEMV's split-K partials are summed. Up to three parts per
output group (q | k | v stacked in one GEMV): a tile inside one part (always at the 8B shapes)
reads that part's slice of t; a tile across a boundary picks each column's part. The last
tile's epilogue (a counter over every GEMV that reads this t) zeroes t for the shrink of the
next call. With partials (NPC > 0: a producer kernel's column blocks or heads each stored its
share, `LoraShrink.ps`) the epilogue sums them as it reads t, and nothing is counted or
zeroed: the next call overwrites them; t is then whole before the GEMV starts, so with
EARLY_TAIL split 0's program adds the delta to its partial sum, off the tile's serial tail.
LR == 0 compiles none of it: the base GEMV as before.
"""

import triton
import triton.language as tl

# rank rows per chunk of the epilogue's products (registers: MP x RC x BN values a chunk); 4
# at one row (71 instead of 137 registers, twice the programs an SM) was slower on an H100
# (2026-12-08 00:15 UTC, one adapter 327.7 t/s against 344.9): the chunks' round trips cost more
RC = tl.constexpr(16)
ZC = tl.constexpr(64)  # columns of t the last epilogue zeroes per store
PC = 1024  # values of t's partials a load takes, [partials, rows, RC] (registers: 32 a thread)


# With partials (t whole before the GEMV starts) a split-K GEMV's delta goes into split 0's
# partial sum, not onto the tile finisher's serial tail (False: the finisher adds it). On since an
# H100 timed it (2026-12-08 00:14 UTC, 8B shape, one rank-16 adapter: 354.5 t/s against 344.9,
# +9.3 % over the base's 387.4 against +12.3 %; tests/perf/results/lora.md)
EARLY_TAIL = True

SHRINK_K, SHRINK_R = 256, 16  # an inline shrink item: columns of x, rows of A
SK, SR = tl.constexpr(SHRINK_K), tl.constexpr(SHRINK_R)


def tail_args(tail, y, x) -> dict:
    """The packed GEMV kernels' LoRA keyword arguments for `tail` (a `LoraTail`, or None: LR=0
    and `y` fills the unused pointers); x: the GEMV's float32 rows (the inline shrink's)."""
    if tail is None:
        return {"lt_ptr": y, "lb_ptr": y, "lc_ptr": y, "l_r": 0, "l_e1": 0, "l_e2": 0,
                "l_lo0": 0, "l_lo1": 0, "l_lo2": 0, "l_rk0": 0, "l_rk1": 0, "l_rk2": 0,
                "l_tiles": 0, "ls_ptr": y, "l_sx": 0, "la_ptr": y, "lw_ptr": y, "l_sw": 0,
                "l_ns": 0, "l_np": 0, "LR": 0, "LS": False, "NPC": 0, "LPS": 0,
                "LE": False}  # fmt: skip
    lo, rk = tail.lo, tail.rank
    r, k = tail.t.shape[1], x.shape[1]
    inline = tail.a is not None
    if tail.np and (inline or not 0 < tail.np <= tail.ps):
        raise ValueError(f"{tail.np} LoRA partials of {tail.ps} (inline: {inline})")
    return {"lt_ptr": tail.t, "lb_ptr": tail.b, "lc_ptr": tail.count, "l_r": r,
            "l_e1": tail.ends[0], "l_e2": tail.ends[1], "l_lo0": lo[0], "l_lo1": lo[1],
            "l_lo2": lo[2], "l_rk0": rk[0], "l_rk1": rk[1], "l_rk2": rk[2],
            "l_tiles": tail.tiles, "ls_ptr": x, "l_sx": x.stride(0),
            "la_ptr": tail.a if inline else y, "lw_ptr": tail.w if inline else y,
            "l_sw": tail.w.stride(0) if inline else 0,
            "l_ns": shrink_items(r, k) if inline else 0, "l_np": tail.np,
            "LR": tail.b.shape[0], "LS": inline,
            "NPC": partial_chunk(tail.np, x.shape[0]), "LPS": tail.ps,
            "LE": bool(EARLY_TAIL and tail.np and not inline)}  # fmt: skip


def partial_chunk(np: int, rows: int) -> int:
    """Partials the epilogue sums per load (a power of two; 0: none, t is whole): all of them
    where [partials, rows, RC] values fit PC (one round trip of loads at one row), else fewer."""
    if not np:
        return 0
    return min(triton.next_power_of_2(np), max(1, PC // (triton.next_power_of_2(rows) * RC.value)))


def shrink_items(r: int, k: int) -> int:
    """The inline shrink's items for a stacked A of r rows and k columns."""
    return triton.cdiv(r, SHRINK_R) * triton.cdiv(k, SHRINK_K)


@triton.jit
def lora_program(lc_ptr, LS: tl.constexpr):
    """(column tile, K chunk, ticket) of this program: its grid position, or with LS (the
    shrink inline) the ticket it takes as it starts. The shrink items go to the first tickets,
    whichever programs the hardware places first; with fewer items than SMs (the host's rule)
    those programs always find room, so tile finishers waiting for the items cannot deadlock."""
    if LS:
        tk = tl.atomic_add(lc_ptr + 2, 1, sem="relaxed")
        tiles = tl.num_programs(0)
        return tk % tiles, tk // tiles, tk
    else:
        return tl.program_id(0), tl.program_id(1), 0


@triton.jit
def lora_shrink_item(tk, ns, x_ptr, sx, a_ptr, w_ptr, sw, t_ptr, lc_ptr, M, K, R,
                     MP: tl.constexpr, LS: tl.constexpr, SPREAD: tl.constexpr):  # fmt: skip
    """With LS, ticket tk does shrink items tk, tk + G, ... below ns (G: the programs; an item:
    SR rows of A x SK columns of x, times W, added into t with atomics) before its GEMV work,
    counting each one done (after `gdc_wait`: x comes from the previous kernel). Without SPREAD
    (the triton interpreter, which runs programs one after another) ticket 0 does them all."""
    if LS:
        SB: tl.constexpr = 64 // MP  # columns per step: MP x SR x SB products in registers
        ks = tl.cdiv(K, SK)
        rows = tl.arange(0, MP)
        tm = rows < M
        if SPREAD:
            first, step = tk, tl.num_programs(0) * tl.num_programs(1)
        else:
            first, step = tk * ns, 1
        for item in range(first, ns, step):
            r = (item // ks) * SR + tl.arange(0, SR)
            rm = r < R
            acc = tl.zeros([MP, SR], dtype=tl.float32)
            for c in range(0, SK, SB):
                k = (item % ks) * SK + c + tl.arange(0, SB)
                km = k < K
                a = tl.load(a_ptr + r[:, None].to(tl.int64) * K + k[None, :],
                            mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)  # fmt: skip
                xb = tl.load(x_ptr + rows[:, None] * sx + k[None, :],
                             mask=tm[:, None] & km[None, :], other=0.0)  # fmt: skip
                acc += tl.sum(xb[:, None, :] * a[None, :, :], axis=2)
            m = tm[:, None] & rm[None, :]
            acc *= tl.load(w_ptr + rows[:, None] * sw + r[None, :], mask=m, other=0.0)
            tl.atomic_add(t_ptr + rows[:, None] * R + r[None, :], acc, mask=m, sem="relaxed")
            tl.debug_barrier()  # every thread's atomics are issued before the item counts
            tl.atomic_add(lc_ptr + 3, 1, sem="release")


@triton.jit
def lora_wait(lc_ptr, ns, LS: tl.constexpr):
    """With LS: spin until all ns shrink items are in t (a tile finisher, before it reads t)."""
    if LS:
        while tl.atomic_add(lc_ptr + 3, 0, sem="acquire") < ns:
            pass


@triton.jit
def _t_chunk(t_ptr, R, rows, rmask, lo, rank, rr, np, NPC: tl.constexpr, PS: tl.constexpr):
    # t was summed by the shrink's atomics in L2 (or its partials stored there by the previous
    # kernel): read it there (no L1 line of an earlier call)
    m = rmask[:, None] & (rr < rank)[None, :]
    off = rows[:, None] * R + (lo + rr)[None, :]
    if NPC == 0:
        t = tl.load(t_ptr + off, mask=m, other=0.0, cache_modifier=".cg")
    else:  # t[row, r] = sum of [row, r, :np]: side by side, vector loads
        t = tl.zeros(m.shape, dtype=tl.float32)
        for p0 in range(0, np, NPC):  # one step where all partials fit a load (one row)
            p = p0 + tl.arange(0, NPC)
            pm = m[:, :, None] & (p < np)[None, None, :]
            at = (off * PS)[:, :, None] + p[None, None, :]  # (PS constexpr: aligned vectors)
            t += tl.sum(tl.load(t_ptr + at, mask=pm, other=0.0, cache_modifier=".cg"), axis=2)
    return t


@triton.jit
def lora_tail(t_ptr, b_ptr, R, rows, rmask, c0, cols, cols_ok, N, e1, e2, lo0, lo1, lo2, rk0,
              rk1, rk2, np, MP: tl.constexpr, BN: tl.constexpr, LR: tl.constexpr,
              NPC: tl.constexpr, PS: tl.constexpr):  # fmt: skip
    """The delta [MP, BN] of output columns `cols` (c0 the first): sum over r of
    t[row, lo_p + r] * b[r, col], p the column's part (from column e1 on part 1, from e2 on
    part 2). NPC > 0: t[row, r] is the sum of t's [row, r, :np] (PS per value), NPC a load."""
    d = tl.zeros([MP, BN], dtype=tl.float32)
    last = tl.minimum(c0 + BN, N) - 1
    p0 = (c0 >= e1).to(tl.int32) + (c0 >= e2).to(tl.int32)
    p1 = (last >= e1).to(tl.int32) + (last >= e2).to(tl.int32)
    if p0 == p1:  # the tile lies in one part (always at the 8B shapes): one slice of t
        lo = tl.where(p0 == 0, lo0, tl.where(p0 == 1, lo1, lo2))
        rank = tl.where(p0 == 0, rk0, tl.where(p0 == 1, rk1, rk2))
        # a loop, not unrolled: unrolled, four rank-16 chunks (LR 64) took the Q4_K GEMV from 163
        # to 243 registers (sm_90, tests/perf/lora_kernel_regs.py), fewer programs per SM
        for c in range(0, LR, RC):
            rr = c + tl.arange(0, RC)
            # rows past a part's rank are zero in b: only the columns need a mask
            b = tl.load(b_ptr + rr[:, None] * N + cols[None, :], mask=cols_ok[None, :], other=0.0)
            t = _t_chunk(t_ptr, R, rows, rmask, lo, rank, rr, np, NPC, PS)
            d += tl.sum(t[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:  # a part boundary inside the tile: each column picks its part (a chunk at a time)
        sel = (cols >= e1).to(tl.int32) + (cols >= e2).to(tl.int32)
        sel3 = sel[None, None, :]
        for c in range(0, LR, RC):
            rr = c + tl.arange(0, RC)
            b = tl.load(b_ptr + rr[:, None] * N + cols[None, :], mask=cols_ok[None, :], other=0.0)
            ta = _t_chunk(t_ptr, R, rows, rmask, lo0, rk0, rr, np, NPC, PS)[:, :, None]
            tb = _t_chunk(t_ptr, R, rows, rmask, lo1, rk1, rr, np, NPC, PS)[:, :, None]
            tc = _t_chunk(t_ptr, R, rows, rmask, lo2, rk2, rr, np, NPC, PS)[:, :, None]
            t = tl.where(sel3 == 0, ta, tl.where(sel3 == 1, tb, tc))  # [MP, RC, BN]
            d += tl.sum(t * b.to(tl.float32)[None, :, :], axis=1)
    return d


@triton.jit
def lora_release(t_ptr, cnt_ptr, R, rows, rmask, tiles, MP: tl.constexpr):
    """Count this tile's epilogue done; the last of `tiles` zeroes t's rows and the counter."""
    tl.debug_barrier()  # every thread's reads of t are done before the tile counts itself
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if done == tiles - 1:
        for c0 in range(0, R, ZC):
            zc = c0 + tl.arange(0, ZC)
            zm = rmask[:, None] & (zc < R)[None, :]
            tl.store(t_ptr + rows[:, None] * R + zc[None, :], tl.zeros((MP, ZC), tl.float32),
                     mask=zm)  # fmt: skip
        # the inline shrink's ticket and item counters too (every program of the module's
        # GEMVs has run: all took their tickets)
        tl.atomic_xchg(cnt_ptr + 2, 0, sem="relaxed")
        tl.atomic_xchg(cnt_ptr + 3, 0, sem="relaxed")
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
