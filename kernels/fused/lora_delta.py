"""The unmerged LoRA delta of one (fused) linear as the kernels compute it: shrink all adapters'
stacked A at once, scale each column by its row's adapter factor, expand into each output part
(the torch reference of `triton_lora`, and the layout both take).

    t = (x @ A_all.T) * W            x [T, in], A_all [R, in], W [T, R]: row t's factor per column
    y_p += t[:, lo_p:hi_p] @ Bt_p    Bt_p [hi_p - lo_p, out_p]: part p's B.T (times its scaling)

One part per output of the linear (q, k, v of a fused attention input; gate, up; or one). A part
whose columns no adapter has is left out by the caller. `scratch` is the per-module buffer pair
the CUDA kernels accumulate t in (allocated here, with torch alone, at load: never inside a
CUDA-graph capture). `LoraTail` is the same expand as an optional epilogue of a base GEMV (the
packed dp4a kernels add it to their output tile: no expand launch); `tail_reference` is its torch
form.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

KERNEL_ROWS = 64  # token rows the triton kernels take (`triton_lora.MAX_ROWS`); more: torch ops
# partial shrinks a module's partials buffer holds (`partials`): a SiLU product's column blocks
# (an 8B's 14,336 in 56 of 256), an attention combine's heads; a producer with more takes wider
# blocks (the SiLU) or runs the shrink's torch form (the combine)
PARTIALS = 64


@dataclass(frozen=True, slots=True)
class LoraPart:
    """One output part: its columns lo..hi of the stacked A and its B.T [hi - lo, out]."""

    lo: int
    hi: int
    b_t: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoraTail:
    """The expand of one base GEMV's output group [T, n] (parts side by side, up to 3), added by
    the GEMV in its epilogue: y[:, c] += t[:, lo_p : lo_p + rank_p] @ b[:rank_p, c] for column c
    of part p (columns ends[p - 1] .. ends[p]). t [rows, r]: the shrink's scaled output (the
    module's scratch); b [rp, n]: each part's B.T in its columns, zero rows past its rank (rp a
    power of two); count: the scratch's counter; `tiles`: the output tiles, over every GEMV of
    the module that reads t, whose epilogues run before the last one zeroes t."""

    t: torch.Tensor
    count: torch.Tensor
    b: torch.Tensor
    ends: tuple[int, int]  # part 0 ends at ends[0], part 1 at ends[1] (n where absent)
    lo: tuple[int, int, int]
    rank: tuple[int, int, int]  # 0: a part no adapter targets
    tiles: int
    # the shrink inline (SCHEME "inline"): the module's stacked A [r, in] and W's columns
    # [rows, r], on the first of its GEMVs only (None: the shrink was launched before)
    a: torch.Tensor | None = None
    w: torch.Tensor | None = None
    # np > 0: t is a partials buffer [rows, r, ps] of which the first np partials of each value
    # are a producer's (`LoraShrink.ps`): the epilogue sums them, and nothing is zeroed after
    # (no counter): the next call overwrites them
    np: int = 0
    ps: int = 0


@dataclass(frozen=True, slots=True)
class LoraShrink:
    """A linear's LoRA shrink handed to the kernel that makes its input (a norm, the SiLU
    product, the flash-decoding combine), which then writes t = (x @ a.T) * w[:T] into the
    scratch itself: a [R, in] the stacked A, w [rows, R] W's columns, t [rows, R] the module's
    scratch (zero before). With ps > 0 t is a partials buffer [rows, R, ps] instead
    (`partials`): the kernel's program p stores its share of t[row, r] at [row, r, p] with a
    plain store (no atomics, no zero needed; the partials of a value side by side, so the
    epilogue's sum reads them as vectors) and tells `done` how many it wrote."""

    a: torch.Tensor
    w: torch.Tensor
    t: torch.Tensor
    ps: int = 0
    done: Callable[[int], None] | None = None

    def wrote(self, parts: int) -> None:
        """A producer's report: it wrote `parts` partials (with ps > 0)."""
        if self.ps and parts > self.ps:
            raise ValueError(f"{parts} partial LoRA shrinks for a buffer of {self.ps}")
        if self.done is not None:
            self.done(parts)

    def reference(self, x: torch.Tensor) -> None:
        """The torch form: t[:T] = (x @ a.T) * w[:T] in float32 (with partials: partial 0 of
        1)."""
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0]
        t = (x2.float() @ self.a.float().T) * self.w[:n].float()
        if self.ps:
            self.t[:n, :, 0] = t
        else:
            self.t[:n] = t
        self.wrote(1)


def make_tail(scratch: tuple, parts: list[tuple[int, LoraPart | None]], tiles: int) -> LoraTail:
    """The `LoraTail` of one GEMV output group: `parts` per output part in column order, (its
    columns, its LoraPart or None where no adapter targets it); `scratch` the module's; `tiles`
    the output tiles of every GEMV of the module that reads it (see `LoraTail`)."""
    if not 0 < len(parts) <= 3:
        raise ValueError(f"a LoRA epilogue takes 1 to 3 output parts, not {len(parts)}")
    on = [p for _, p in parts if p is not None]
    if not on:
        raise ValueError("a LoRA epilogue needs a part with an adapter")
    ranks = [0 if p is None else p.hi - p.lo for _, p in parts]
    rp = max(16, 1 << (max(ranks) - 1).bit_length())
    n = sum(cols for cols, _ in parts)
    b = torch.zeros(rp, n, dtype=on[0].b_t.dtype, device=on[0].b_t.device)
    ends, c0 = [], 0
    for (cols, p), rk in zip(parts, ranks, strict=True):
        if p is not None:
            b[:rk, c0 : c0 + cols] = p.b_t
        c0 += cols
        ends.append(c0)
    lo = [0 if p is None else p.lo for _, p in parts]
    pad = 3 - len(parts)
    return LoraTail(
        t=scratch[0], count=scratch[1], b=b, ends=(*ends[:-1], *[n] * pad)[:2],
        lo=(*lo, *[0] * pad), rank=(*ranks, *[0] * pad), tiles=tiles,
    )  # fmt: skip


def tail_reference(y: torch.Tensor, tail: LoraTail) -> torch.Tensor:
    """y [T, n] plus the tail's delta, in float32 (does not touch t)."""
    n = y.shape[0]
    t = tail.t[:n, :, : tail.np].sum(-1) if tail.np else tail.t[:n].float()
    out = y.float().clone()
    starts = (0, *tail.ends)
    ends = (*tail.ends, y.shape[1])
    for p in range(3):
        lo, rk, c0, c1 = tail.lo[p], tail.rank[p], starts[p], ends[p]
        if rk and c1 > c0:
            out[:, c0:c1] += t[:, lo : lo + rk] @ tail.b[:rk, c0:c1].float()
    return out


def shrink_expand_reference(
    x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, parts: list[LoraPart],
    ys: list[torch.Tensor],
) -> None:  # fmt: skip
    """ys[p] += the delta of part p, in place, computed in float32 (x [T, in], a [R, in], w: at
    least T rows [., R])."""
    t = (x.float() @ a.float().T) * w[: x.shape[0]].float()
    for part, y in zip(parts, ys, strict=True):
        y += (t[:, part.lo : part.hi] @ part.b_t.float()).to(y.dtype)


def partials(r: int, rows: int, device) -> torch.Tensor:
    """The zeroed partials buffer [rows, r, PARTIALS] float32 of one module's producer shrinks
    (`LoraShrink.ps` = PARTIALS)."""
    return torch.zeros(rows, max(r, 1), PARTIALS, dtype=torch.float32, device=device)


def scratch(r: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed (t [KERNEL_ROWS, r] float32, counters [4] int32) one module's kernel calls
    share; the kernels leave them at zero after every call (CUDA graphs replay them as is)."""
    t = torch.zeros(KERNEL_ROWS, max(r, 1), dtype=torch.float32, device=device)
    return t, torch.zeros(4, dtype=torch.int32, device=device)
