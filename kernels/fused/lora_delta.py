"""The unmerged LoRA delta of one (fused) linear as the kernels compute it: shrink all adapters'
stacked A at once, scale each column by its row's adapter factor, expand into each output part
(the torch reference of `triton_lora`, and the layout both take).

    t = (x @ A_all.T) * W            x [T, in], A_all [R, in], W [T, R]: row t's factor per column
    y_p += t[:, lo_p:hi_p] @ Bt_p    Bt_p [hi_p - lo_p, out_p]: part p's B.T (times its scaling)

One part per output of the linear (q, k, v of a fused attention input; gate, up; or one). A part
whose columns no adapter has is left out by the caller. `scratch` is the per-module buffer pair
the CUDA kernels accumulate t in (allocated here, with torch alone, at load: never inside a
CUDA-graph capture).
"""

from dataclasses import dataclass

import torch

KERNEL_ROWS = 64  # token rows the triton kernels take (`triton_lora.MAX_ROWS`); more: torch ops


@dataclass(frozen=True, slots=True)
class LoraPart:
    """One output part: its columns lo..hi of the stacked A and its B.T [hi - lo, out]."""

    lo: int
    hi: int
    b_t: torch.Tensor


def shrink_expand_reference(
    x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, parts: list[LoraPart],
    ys: list[torch.Tensor],
) -> None:  # fmt: skip
    """ys[p] += the delta of part p, in place, computed in float32 (x [T, in], a [R, in], w: at
    least T rows [., R])."""
    t = (x.float() @ a.float().T) * w[: x.shape[0]].float()
    for part, y in zip(parts, ys, strict=True):
        y += (t[:, part.lo : part.hi] @ part.b_t.float()).to(y.dtype)


def scratch(r: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed (t [KERNEL_ROWS, r] float32, counters [2] int32) one module's kernel calls
    share; the kernels leave them at zero after every call (CUDA graphs replay them as is)."""
    t = torch.zeros(KERNEL_ROWS, max(r, 1), dtype=torch.float32, device=device)
    return t, torch.zeros(2, dtype=torch.int32, device=device)
