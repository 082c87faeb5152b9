"""Device expert slots filled from the file at the GPU's own request (the disk tier through
`offload.expert_reads`): once `slot_lru.assign` has queued a layer's misses, `request` posts
their expert ids to a mailbox in page-locked host memory and spins until the host's reader
thread has staged their bytes (a step without a miss returns at once, the host never hears of
it), `copy_staged` brings the staged raw bytes over the bus into device scratch with every SM,
and `pack_staged` lays each expert into its slot's planes by the pool's byte maps (one gather
per plane: `PackedSlotPool.byte_maps`, whose reference is `fill_raw`). All of it is captured in a
decode graph. Mailbox words: see `offload/expert_reads.c`. Imported only where CUDA exists (or
under TRITON_INTERPRET=1 in tests: CPU tensors, no fence instruction emitted).
"""

import torch
import triton
import triton.language as tl

# polls of the answer word (each a read over the bus, ~1 us): a stalled reader fails the step
# after some seconds instead of hanging it; later requests then skip waiting (BOX_ERR is set)
SPIN_LIMIT = 1 << 24
COPY_WORDS = 4096  # int32 words one copy program moves
PACK_BYTES = 4096  # slot bytes one packing program writes per pass
# programs per job (and plane): each loops over its share (few programs idle fast); over the
# bus 128 kept more loads in flight than 64 (H200: (c) tg64 149 against 136-145 t/s)
PROGRAMS = 128


@triton.jit
def _request(njob_ptr, job_ptr, box_ptr, seq_ptr, ahead_ptr, layer, MAXJ: tl.constexpr,
             SPIN: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
    n = tl.load(njob_ptr)
    failed = tl.load(box_ptr + 4, volatile=True)
    if not WAIT:  # a read-ahead: nothing in flight unless posted below
        tl.store(ahead_ptr, 0)
    if (n > 0) & (failed == 0):
        offs = tl.arange(0, MAXJ)
        m = offs < n
        e = tl.load(job_ptr + 2 * offs + 1, mask=m, other=0)
        tl.store(box_ptr + 8 + offs, e.to(tl.int64), mask=m)
        tl.store(box_ptr + 2, layer)
        tl.store(box_ptr + 3, n.to(tl.int64))
        seq = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, seq)
        tl.debug_barrier()  # every thread's stores above are issued before the fence
        if FENCE:  # ... and visible to the host before the request number that announces them
            seq = tl.inline_asm_elementwise(
                "fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [seq], dtype=tl.int64,
                is_pure=False, pack=1,
            )  # fmt: skip
        tl.store(box_ptr + 0, seq)
        if WAIT:
            _wait_for(box_ptr, seq, SPIN)
        else:  # answered while the GPU computes on: `settle` waits for it before the next post
            tl.store(ahead_ptr, seq)
            tl.store(ahead_ptr + 1, tl.load(ahead_ptr + 1) + n)


@triton.jit
def _wait_for(box_ptr, seq, SPIN: tl.constexpr):
    done = tl.load(box_ptr + 1, volatile=True)
    i = 0
    while (done < seq) & (i < SPIN):
        done = tl.load(box_ptr + 1, volatile=True)
        i += 1
    if done < seq:  # (offload.expert_reads.TIMED_OUT)
        tl.store(box_ptr + 4, -2)


def request(njobs: torch.Tensor, jobs: torch.Tensor, box: torch.Tensor, seq: torch.Tensor,
            layer: int, max_jobs: int, spin: int = SPIN_LIMIT,
            ahead: torch.Tensor | None = None) -> None:  # fmt: skip
    """Post the queued jobs' experts of `layer` to the reader's mailbox `box` (int64, mapped
    host memory) and wait for its answer; `seq` int64 [1] on the device numbers the requests.
    With `ahead` (int64 [2] on the device: the request in flight, experts read ahead so far) the
    post is a read-ahead: no wait, the request's number goes to `ahead[0]` (0: none posted)."""
    _request[(1,)](njobs, jobs, box, seq, seq if ahead is None else ahead, layer,
                   MAXJ=triton.next_power_of_2(max(max_jobs, 2)), SPIN=spin,
                   FENCE=box.is_cuda, WAIT=ahead is None, num_warps=1)  # fmt: skip


@triton.jit
def _settle(box_ptr, ahead_ptr, seq_ptr, job_ptr, njob_ptr, slot_of_ptr, expert_of_ptr,
            MAXJ: tl.constexpr, SPIN: tl.constexpr):  # fmt: skip
    n = tl.load(njob_ptr)
    if n > 0:
        posted = tl.load(ahead_ptr)
        intact = (posted > 0) & (posted == tl.load(seq_ptr))  # no request since: rows intact
        if intact & (tl.load(box_ptr + 4, volatile=True) == 0):
            _wait_for(box_ptr, posted, SPIN)
        else:  # never posted, or its staging rows reused since: the slots hold nothing
            offs = tl.arange(0, MAXJ)
            m = offs < n
            slot = tl.load(job_ptr + 2 * offs, mask=m, other=0)
            e = tl.load(job_ptr + 2 * offs + 1, mask=m, other=0)
            tl.store(slot_of_ptr + e, -1, mask=m)
            tl.store(expert_of_ptr + slot, -1, mask=m)
            tl.store(njob_ptr, 0)
    tl.store(ahead_ptr, 0)


def settle(box: torch.Tensor, ahead: torch.Tensor, seq: torch.Tensor, jobs: torch.Tensor,
           njobs: torch.Tensor, lru, max_jobs: int, spin: int = SPIN_LIMIT) -> None:  # fmt: skip
    """A layer's read-ahead (`jobs`, `njobs`: slots its guesses were given in `lru`) before the
    layer runs: waited for when it was the last request (its staging rows are then intact, for
    `copy_staged`); otherwise (never posted, or the rows reused since) its slots are emptied and
    `njobs` zeroed. The read-ahead in flight (`ahead[0]`) is cleared."""
    _settle[(1,)](box, ahead, seq, jobs, njobs, lru.slot_of, lru.expert_of,
                  MAXJ=triton.next_power_of_2(max(max_jobs, 2)), SPIN=spin,
                  num_warps=1)  # fmt: skip


@triton.jit
def _copy(njob_ptr, src_ptr, dst_ptr, STRIDE, WORDS, CH: tl.constexpr, NP: tl.constexpr,
          CV: tl.constexpr):  # fmt: skip
    j, c = tl.program_id(0), tl.program_id(1)
    if j < tl.load(njob_ptr):
        base = j.to(tl.int64) * STRIDE
        for start in range(c * CH, WORDS, NP * CH):
            offs = start + tl.arange(0, CH)
            m = offs < WORDS
            if CV:  # the host wrote these bytes since the last copy: never an older cached line
                v = tl.load(src_ptr + base + offs, mask=m, volatile=True)
            else:
                v = tl.load(src_ptr + base + offs, mask=m)
            tl.store(dst_ptr + base + offs, v, mask=m)


def copy_staged(njobs: torch.Tensor, staging: torch.Tensor, scratch: torch.Tensor,
                max_jobs: int, nbytes: int) -> None:  # fmt: skip
    """The first `nbytes` of staging rows 0..njobs (uint8 [cap, stride], mapped host memory)
    into the same rows of `scratch` (the device's)."""
    stride = staging.shape[1] // 4
    words = -(-nbytes // 4)
    grid = (max_jobs, min(PROGRAMS, triton.cdiv(words, COPY_WORDS)))
    _copy[grid](njobs, staging.view(torch.int32), scratch.view(torch.int32), stride, words,
                CH=COPY_WORDS, NP=grid[1], CV=staging.is_cuda, num_warps=4)  # fmt: skip


@triton.jit
def _pack(njob_ptr, job_ptr, src_ptr, STRIDE, desc_ptr, CH: tl.constexpr, NP: tl.constexpr,
          VOL: tl.constexpr):  # fmt: skip
    j, f, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if j < tl.load(njob_ptr):
        slot = tl.load(job_ptr + 2 * j).to(tl.int64)
        index = tl.load(desc_ptr + 4 * f).to(tl.pointer_type(tl.int32))
        dst = tl.load(desc_ptr + 4 * f + 1) + slot * tl.load(desc_ptr + 4 * f + 2)
        dst = dst.to(tl.pointer_type(tl.uint8))
        n = tl.load(desc_ptr + 4 * f + 3)
        src = src_ptr + j.to(tl.int64) * STRIDE
        for start in range(c * CH, n, NP * CH):
            offs = start + tl.arange(0, CH)
            m = offs < n
            at = tl.load(index + offs, mask=m, other=0)
            if VOL:  # straight from the staging rows the host rewrites (as `_copy` reads them)
                v = tl.load(src + at, mask=m, volatile=True)
            else:
                v = tl.load(src + at, mask=m)
            tl.store(dst + offs, v, mask=m)


def pack_descriptors(planes: list[torch.Tensor], maps: list[torch.Tensor]) -> torch.Tensor:
    """int64 [planes, 4] for `pack_staged`: per slot plane (uint8 [slots, bytes] views), its
    byte map's address, the plane's base, bytes per slot, bytes per slot used."""
    rows = []
    for plane, index in zip(planes, maps, strict=True):
        if index.numel() != plane.shape[1] or index.dtype != torch.int32:
            raise ValueError("a byte map must give an int32 source byte for each plane byte")
        rows.append([index.data_ptr(), plane.data_ptr(), plane.stride(0), plane.shape[1]])
    return torch.tensor(rows, dtype=torch.int64, device=planes[0].device)


def pack_staged(njobs: torch.Tensor, jobs: torch.Tensor, scratch: torch.Tensor,
                desc: torch.Tensor, max_jobs: int, max_bytes: int,
                staged: bool = False) -> None:  # fmt: skip
    """Each queued job's raw expert (scratch row j) packed into its slot (jobs [j, 0]).
    `staged`: `scratch` is the reader's staging itself (mapped host memory, read in place)."""
    grid = (max_jobs, desc.shape[0], min(PROGRAMS, triton.cdiv(max_bytes, PACK_BYTES)))
    _pack[grid](njobs, jobs, scratch, scratch.shape[1], desc, CH=PACK_BYTES, NP=grid[2],
                VOL=staged and scratch.is_cuda, num_warps=4)  # fmt: skip
