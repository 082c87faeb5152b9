"""MusicGen's delay pattern: codebook k of a frame is predicted k steps after codebook 0, so one
decoder step emits all K codebooks and each still sees the coarser codes of its own frame.

Over a sequence of `frames + delays` positions, position 0 is the BOS (the pad id) of every
row and row r holds frame j at position j + delay(r) + 1; the positions before and after are the
pad id. Stereo checkpoints interleave left and right codebooks (rows 2k and 2k+1 share delay k).
A pattern entry of -1 marks a position the model must generate; any other value is forced
(pad, or a code of the clip being continued).
"""

from __future__ import annotations

import torch

FREE = -1


def row_delays(num_codebooks: int, channels: int) -> list[int]:
    """The delay of each decoder row (interleaved left/right rows share one)."""
    return [r // channels for r in range(num_codebooks)]


def pattern(
    frames: int, num_codebooks: int, channels: int, pad: int, prompt: torch.Tensor | None = None
) -> torch.Tensor:
    """The (K, frames + K/channels) pattern for `frames` frames, `prompt` (K, P) forced first."""
    delays = row_delays(num_codebooks, channels)
    length = frames + max(delays) + 1
    out = torch.full((num_codebooks, length), pad, dtype=torch.long)
    for r, d in enumerate(delays):
        out[r, d + 1 : d + 1 + frames] = FREE
        if prompt is not None and prompt.shape[1]:
            out[r, d + 1 : d + 1 + prompt.shape[1]] = prompt[r]
    return out


def first_free(pat: torch.Tensor) -> int:
    """The first position to generate (row 0 has no delay, so it says first)."""
    free = (pat[0] == FREE).nonzero()
    return int(free[0]) if len(free) else pat.shape[1]


def undelay(seq: torch.Tensor, channels: int, frames: int) -> torch.Tensor:
    """The (..., K, frames) codes of a delayed (..., K, length) sequence."""
    rows = [
        seq[..., r, d + 1 : d + 1 + frames]
        for r, d in enumerate(row_delays(seq.shape[-2], channels))
    ]
    return torch.stack(rows, dim=-2)
