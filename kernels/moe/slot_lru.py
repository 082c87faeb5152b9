"""A device-side LRU of expert slots: which slot serves each routed (token, expert) pair, with the
missing experts copied into the least recently used slots by GPU kernels, so no routing decision
reaches the host and a decode graph captures the whole step.

State per layer (device tensors, `LruState`): slot_of [E] (-1: not cached), expert_of [S] (-1:
empty), stamp [S] (the step a slot was last used; -1 at first), and counters [3] (step clock,
pairs looked up, pairs missed). `assign` walks the pairs in order in one program: a cached expert
stamps its slot; a missing one takes the slot with the oldest stamp (the lowest index on a tie;
never one used in this step while S >= the step's distinct experts), and a copy job (slot,
expert) is queued. `copy_jobs` then moves each queued expert's planes from their source (mapped
host memory) into its slot. `assign_reference` is the plain-torch oracle of `assign`.
Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

COPY_WORDS = 4096  # int32 words one copy program moves


@dataclass(frozen=True)
class LruState:
    slot_of: torch.Tensor  # int32 [E]
    expert_of: torch.Tensor  # int32 [S]
    stamp: torch.Tensor  # int64 [S]
    counters: torch.Tensor  # int64 [3]: clock, lookups, misses

    @classmethod
    def empty(cls, n_expert: int, slots: int, device) -> "LruState":
        return cls(
            torch.full((n_expert,), -1, dtype=torch.int32, device=device),
            torch.full((slots,), -1, dtype=torch.int32, device=device),
            torch.full((slots,), -1, dtype=torch.int64, device=device),
            torch.zeros(3, dtype=torch.int64, device=device),
        )


@triton.jit
def _assign(
    ids_ptr, slot_of_ptr, expert_of_ptr, stamp_ptr, cnt_ptr, out_ptr, job_ptr, njob_ptr, S,
    P: tl.constexpr, SP: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    clock = tl.load(cnt_ptr) + 1
    offs = tl.arange(0, SP)
    smask = offs < S
    n = tl.full([], 0, tl.int32)
    for p in range(0, P):
        e = tl.load(ids_ptr + p)
        s = tl.load(slot_of_ptr + e)
        if s < 0:
            st = tl.load(stamp_ptr + offs, mask=smask, other=1 << 62)
            v = tl.argmin(st, 0).to(tl.int32)
            old = tl.load(expert_of_ptr + v)
            if old >= 0:
                tl.store(slot_of_ptr + old, -1)
            tl.store(slot_of_ptr + e, v)
            tl.store(expert_of_ptr + v, e.to(tl.int32))
            tl.store(job_ptr + 2 * n, v)
            tl.store(job_ptr + 2 * n + 1, e.to(tl.int32))
            n += 1
            s = v
        tl.store(stamp_ptr + s, clock)
        tl.store(out_ptr + p, s.to(tl.int64))
        tl.debug_barrier()  # the next pair reads what this one wrote
    tl.store(njob_ptr, n)
    tl.store(cnt_ptr, clock)
    if COUNT:
        tl.store(cnt_ptr + 1, tl.load(cnt_ptr + 1) + P)
        tl.store(cnt_ptr + 2, tl.load(cnt_ptr + 2) + n)


def assign(
    ids: torch.Tensor, st: LruState, jobs: torch.Tensor, njobs: torch.Tensor, count: bool = True
) -> torch.Tensor:
    """Slots for routed ids (any shape, int64) -> int64 slots of the same shape; queues copy
    jobs in `jobs` int32 [>= pairs, 2] and their count in `njobs` int32 [1]. `count`: add the
    pairs to the lookup and miss counters (not for a read-ahead's guesses)."""
    flat = ids.reshape(-1)
    out = torch.empty_like(flat)
    s = st.expert_of.numel()
    _assign[(1,)](
        flat, st.slot_of, st.expert_of, st.stamp, st.counters, out, jobs, njobs, s,
        P=flat.numel(), SP=triton.next_power_of_2(s), COUNT=count, num_warps=1,
    )  # fmt: skip
    return out.view(ids.shape)


def assign_reference(ids: torch.Tensor, st: LruState) -> tuple[torch.Tensor, list]:
    """`assign` in plain torch on CPU copies (updates `st` in place): (slots, jobs)."""
    clock = int(st.counters[0]) + 1
    out, jobs = [], []
    for e in ids.reshape(-1).tolist():
        s = int(st.slot_of[e])
        if s < 0:
            s = int(torch.argmin(st.stamp))
            old = int(st.expert_of[s])
            if old >= 0:
                st.slot_of[old] = -1
            st.slot_of[e], st.expert_of[s] = s, e
            jobs.append((s, e))
        st.stamp[s] = clock
        out.append(s)
    st.counters.add_(torch.tensor([1, ids.numel(), len(jobs)]))
    return torch.tensor(out).view(ids.shape), jobs


@triton.jit
def _copy(job_ptr, njob_ptr, desc_ptr, CH: tl.constexpr):
    j, f, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if j < tl.load(njob_ptr):
        slot = tl.load(job_ptr + 2 * j).to(tl.int64)
        e = tl.load(job_ptr + 2 * j + 1).to(tl.int64)
        src = tl.load(desc_ptr + 5 * f) + e * tl.load(desc_ptr + 5 * f + 1)
        dst = tl.load(desc_ptr + 5 * f + 2) + slot * tl.load(desc_ptr + 5 * f + 3)
        words = tl.load(desc_ptr + 5 * f + 4)
        offs = c * CH + tl.arange(0, CH)
        m = offs < words
        v = tl.load(src.to(tl.pointer_type(tl.int32)) + offs, mask=m)
        tl.store(dst.to(tl.pointer_type(tl.int32)) + offs, v, mask=m)


def copy_descriptors(pairs: list[tuple[torch.Tensor, torch.Tensor]], device) -> torch.Tensor:
    """int64 [fields, 5] for `copy_jobs`: per (source [E, ...], slots [S, ...]) plane pair, the
    source base, its bytes per expert, the slot base, its bytes per slot, int32 words per expert."""
    rows = []
    for src, dst in pairs:
        per = src[0].numel() * src.element_size()
        if per % 4 or dst[0].numel() * dst.element_size() != per:
            raise ValueError("planes must hold whole int32 words per expert and match the slots")
        rows.append([src.data_ptr(), src.stride(0) * src.element_size(), dst.data_ptr(),
                     dst.stride(0) * dst.element_size(), per // 4])  # fmt: skip
    return torch.tensor(rows, dtype=torch.int64, device=device)


def copy_jobs(jobs: torch.Tensor, njobs: torch.Tensor, desc: torch.Tensor, max_jobs: int,
              max_words: int) -> None:  # fmt: skip
    """Copy every queued expert's planes into its slot (programs past `njobs` do nothing)."""
    grid = (max_jobs, desc.shape[0], triton.cdiv(max_words, COPY_WORDS))
    _copy[grid](jobs, njobs, desc, CH=COPY_WORDS, num_warps=4)
