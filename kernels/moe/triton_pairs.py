"""`pairs.sort_pairs` in two CUDA launches: a prompt's (token, expert) pairs grouped by expert and
padded to whole row blocks, the same rows and block experts bit for bit.

The torch recipe costs ~20 launches and as many host-side op dispatches per MoE layer; a
prompt's layers were bound by those dispatches on an H200 (a 512-token Qwen3-30B-A3B layer: ~1 ms
of kernels, ~3 ms of host time). One program doing it all took 178 us there (a serial loop over
4,096 pairs), so the pairs are cut into chunks: the first launch counts each chunk's pairs per
expert (and fills the rows with -1), the second places each chunk's pairs at their expert's
padded start + the same expert's pairs in earlier chunks + their rank in the chunk (stable, like
the torch sort) and names each row block's expert. Imported only where CUDA exists (or under
TRITON_INTERPRET=1 in tests).
"""

import torch
import triton
import triton.language as tl

from localllm.kernels.moe.pairs import SortedPairs, pair_blocks

CHUNK = 128  # pairs per program


@triton.jit
def _one_hot(ids_ptr, c, P, BP: tl.constexpr, BE: tl.constexpr):
    p = c * BP + tl.arange(0, BP)
    x = tl.load(ids_ptr + p, mask=p < P, other=0)
    hot = (x[:, None] == tl.arange(0, BE)[None, :]) & (p < P)[:, None]
    return p, hot.to(tl.int32)


@triton.jit
def _count_chunks(
    ids_ptr, counts_ptr, rows_ptr, P, NCH, NROWS,
    BP: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    _, hot = _one_hot(ids_ptr, c, P, BP, BE)
    e = tl.arange(0, BE)
    tl.store(counts_ptr + c * BE + e, tl.sum(hot, axis=0), mask=(e < BE) & (c < NCH))
    r = c * BR + tl.arange(0, BR)
    tl.store(rows_ptr + r, tl.full([BR], -1, tl.int32), mask=r < NROWS)


@triton.jit
def _place_pairs(
    ids_ptr, counts_ptr, rows_ptr, experts_ptr, P, E, NCH, NBLOCKS,
    BM: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr,
    BC: tl.constexpr, NC: tl.constexpr,
):  # fmt: skip
    # NC: trips over the chunk counts in BC rows, a power of two (a few compiled variants; the
    # interpreter cannot loop to a run-time bound)
    c = tl.program_id(0)
    e = tl.arange(0, BE)
    total = tl.zeros([BE], dtype=tl.int32)
    before = tl.zeros([BE], dtype=tl.int32)  # this expert's pairs in earlier chunks
    for i in range(NC):
        rc = i * BC + tl.arange(0, BC)
        n = tl.load(counts_ptr + rc[:, None] * BE + e[None, :], mask=(rc < NCH)[:, None], other=0)
        total += tl.sum(n, axis=0)
        before += tl.sum(tl.where((rc < c)[:, None], n, 0), axis=0)
    padded = tl.where(e < E, (total + BM - 1) // BM * BM, 0)
    pend = tl.cumsum(padded, axis=0)
    p, hot = _one_hot(ids_ptr, c, P, BP, BE)
    rank = tl.cumsum(hot, axis=0) - 1  # earlier pairs of the same expert in this chunk
    pos = tl.sum(hot * ((pend - padded + before)[None, :] + rank), axis=1)
    tl.store(rows_ptr + pos, p.to(tl.int32), mask=p < P)
    b = c * BR + tl.arange(0, BR)
    ended = (pend[None, :] <= (b * BM)[:, None]) & (e < E)[None, :]
    ex = tl.sum(ended.to(tl.int32), axis=1)  # searchsorted(pend, block start, right=True)
    tl.store(experts_ptr + b, tl.where(ex < E, ex, -1), mask=b < NBLOCKS)


def sort_pairs_cuda(ids: torch.Tensor, n_expert: int, bm: int) -> SortedPairs:
    """Flat expert ids [P] (any integer dtype) -> SortedPairs, as `pairs.sort_pairs`."""
    flat = ids.reshape(-1).contiguous()
    p, dev = flat.numel(), flat.device
    blocks = pair_blocks(p, n_expert, bm)
    be, br = triton.next_power_of_2(n_expert), 256
    nch = -(-p // CHUNK)
    rows = torch.empty(blocks * bm, dtype=torch.int32, device=dev)
    experts = torch.empty(blocks, dtype=torch.int32, device=dev)
    counts = torch.empty(nch, be, dtype=torch.int32, device=dev)
    grid = (max(nch, -(-blocks * bm // br)),)
    _count_chunks[grid](flat, counts, rows, p, nch, blocks * bm, BP=CHUNK, BE=be, BR=br)
    bc = min(32, triton.next_power_of_2(nch))
    grid = (max(nch, -(-blocks // br)),)
    _place_pairs[grid](
        flat, counts, rows, experts, p, n_expert, nch, blocks, BM=bm, BP=CHUNK, BE=be, BR=br,
        BC=bc, NC=triton.next_power_of_2(-(-nch // bc)),
    )  # fmt: skip
    return SortedPairs(rows, experts, bm, p)
