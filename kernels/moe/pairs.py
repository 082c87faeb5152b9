"""(token, expert) pairs grouped by expert for grouped GEMMs: sorted and padded to whole row
blocks per expert on the pairs' device, with no host sync (the launch takes an upper bound of
blocks; blocks past the last expert's rows see expert -1). Plain torch: runs anywhere.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SortedPairs:
    """`pairs` padded to `bm` rows per expert: `rows` int32 [blocks * bm] (pair or -1) and
    `experts` int32 [blocks] (each row block's expert, -1 past the end)."""

    rows: torch.Tensor
    experts: torch.Tensor
    bm: int
    pairs: int


def block_rows(pairs: int, n_expert: int) -> int:
    """Rows per block for `pairs` spread over `n_expert` experts: big blocks where experts get
    many rows (fewer re-reads of each weight tile), small where most of a block would be
    padding."""
    per = pairs / max(n_expert, 1)  # H200, Q4_K 1536x2048 x 128 experts: 16 best at 8 rows
    return 16 if per <= 12 else 64  # per expert, 64 at 32 and 128 (bench_moe_prefill)


def pair_blocks(pairs: int, n_expert: int, bm: int) -> int:
    """Row blocks enough for `pairs` over `n_expert` experts whatever the routing: each used
    expert pads its rows to a whole block (at most bm - 1 rows of padding each)."""
    return -(-(pairs + min(n_expert, pairs) * (bm - 1)) // bm)


def sort_pairs(ids: torch.Tensor, n_expert: int, bm: int) -> SortedPairs:
    """Flat expert ids [P] -> SortedPairs, on the ids' device with no host sync."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    counts = torch.zeros(n_expert, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pend = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    shift = (pend - padded) - (counts.cumsum(0) - counts)  # padded start - packed start
    blocks = pair_blocks(p, n_expert, bm)
    rows = torch.full((blocks * bm,), -1, dtype=torch.int32, device=dev)
    rows[torch.arange(p, device=dev) + shift[flat[order]]] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * bm
    experts = torch.searchsorted(pend, starts, right=True)
    experts = torch.where(experts < n_expert, experts, -1).to(torch.int32)
    return SortedPairs(rows, experts, bm, p)
