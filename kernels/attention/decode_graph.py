"""A fixed-shape decode gather plan built on the device, for CUDA-graph replay.

`plan_decode` builds the gather plan on the host from each sequence's length, so its shapes change
every step. Here every sequence attends over its whole padded block table ([B, max_blocks] on the
device) and the key mask comes from the device-side sequence lengths: the shapes depend only on
(B, max_blocks), and building the plan needs no host sync, so a captured graph can replay it.
"""

from dataclasses import dataclass

import torch

from localllm.kernels.attention.decode_plan import DecodePlan


@dataclass(frozen=True, slots=True)
class PaddedPositions:
    """Key positions 0..m-1 of a padded table (m = max_blocks * block_size), split by block."""

    pos: torch.Tensor  # [m] int64
    block: torch.Tensor  # [m] int64: pos // block_size
    offset: torch.Tensor  # [m] int64: pos % block_size

    @staticmethod
    def make(max_blocks: int, block_size: int, device: torch.device) -> "PaddedPositions":
        pos = torch.arange(max_blocks * block_size, device=device)
        return PaddedPositions(pos, pos // block_size, pos % block_size)


def padded_decode_plan(
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    where: PaddedPositions,
    block_size: int,
    window: int | None = None,
) -> DecodePlan:
    """Plan for B single-token sequences (row b of q is sequence b): tables [B, max_blocks] int64
    (entries past a sequence's blocks may be any valid block id), seq_lens [B] int64 (context
    length after the step). Keys at positions >= seq_len (or outside `window`) are masked;
    `span` holds the visible range: the flash kernel's work follows the real length, not m."""
    slots = tables[:, where.block] * block_size + where.offset  # [B, m]
    pad = where.pos[None, :] >= seq_lens[:, None]
    lo = torch.zeros_like(seq_lens)
    if window:
        lo = (seq_lens - window).clamp(min=0)
        pad |= where.pos[None, :] < lo[:, None]
    # Masked keys re-read position 0's slot (always written): an unwritten slot may hold NaN, and
    # a zero softmax weight times NaN is still NaN.
    slots = torch.where(pad, slots[:, :1], slots)
    rows = torch.arange(tables.shape[0], device=tables.device)
    # the visible keys are one range of positions: the flash kernel skips the padding after it
    span = torch.stack((lo, seq_lens), 1)
    # on the host (a graph's function run eagerly on the CPU) the lengths and tables go along:
    # the native decode attention then serves its rows with the eager step's bits
    host = (seq_lens, tables) if tables.device.type == "cpu" else (None, None)
    return DecodePlan(rows, slots, pad[:, None, None, :], *host, span=span)
