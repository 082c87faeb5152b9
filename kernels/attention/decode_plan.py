"""The gather plan of a decode step: which cache slots each single-token sequence reads.

It depends only on the step's layout and the window, so it is built once per step and used by
every layer, by the torch path (`decode`) and the flash-decoding kernel (`triton_decode`) alike.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecodePlan:
    rows: torch.Tensor  # [nd] int64: the query row of each single-token sequence
    slots: torch.Tensor  # [nd, m] int64: cache slots of its visible keys (padding repeats one)
    pad: torch.Tensor | None  # [nd, 1, 1, m] bool, True on padding (None when all are full)
    # each sequence's length [nd] and block table [nd, W] (zero-padded), int64 on the host: what
    # the CPU's native decode attention (`kernels/cpu/paged_decode`) reads instead of `slots`
    lens: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    # [nd, 2] int64 on the plan's device: the visible keys [lo, hi) along m (the rest is padding),
    # which the flash-decoding split reads alone (None: all m keys, `pad` masking)
    span: torch.Tensor | None = None


def plan_decode(
    query_start: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    window: int | None = None,
) -> DecodePlan | None:
    """The gather plan for the step's single-token sequences (None when fewer than two)."""
    picked = [b for b in range(len(seq_lens)) if query_start[b + 1] - query_start[b] == 1]
    if len(picked) < 2:
        return None
    spans = []
    for b in picked:
        n = seq_lens[b]
        lo = max(0, n - window) if window else 0
        spans.append((lo, n))
    m = max(n - lo for lo, n in spans)
    slots = torch.zeros(len(picked), m, dtype=torch.long)
    pad = torch.zeros(len(picked), m, dtype=torch.bool)
    for i, (b, (lo, n)) in enumerate(zip(picked, spans, strict=True)):
        pos = torch.arange(lo, n)
        table = torch.tensor(block_tables[b], dtype=torch.long)
        row = table[pos // block_size] * block_size + pos % block_size
        slots[i, : n - lo] = row
        # Padding re-reads one of the sequence's own keys: an unwritten slot may hold NaN, and
        # a zero softmax weight times NaN is still NaN.
        slots[i, n - lo :] = row[0]
        pad[i, n - lo :] = True
    rows = torch.tensor([query_start[b] for b in picked], dtype=torch.long)
    lens, tables = host_tables([seq_lens[b] for b in picked], [block_tables[b] for b in picked])
    return DecodePlan(rows, slots, pad[:, None, None, :] if pad.any() else None, lens, tables)


def host_tables(
    seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths [n] and block tables [n, W] (zero-padded to the longest) as int64 tensors."""
    w = max(len(t) for t in block_tables)
    tables = torch.zeros(len(block_tables), w, dtype=torch.long)
    for i, t in enumerate(block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return torch.tensor(list(seq_lens), dtype=torch.long), tables
