"""Plain-torch references of the fused decoder steps; on CUDA tensors they run the triton kernels
of `triton_ops` (one launch each instead of 2-6 eager kernels; decode on a GPU is launch-bound
once the GEMVs are fast). The `_q` variants also return their output quantized for the dp4a
GEMV that reads it next (None on CPU, or for rows the GEMVs would not take quantized)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows up to which a GEMV takes a pre-quantized activation (`triton_packed.MAX_ROWS`; kept here
# so CPU code never imports triton).
QUANT_MAX_ROWS = 4


@dataclass(frozen=True)
class WeightedRows:
    """A residual not yet summed: row t is the sum over j of weights[t, j] * rows[t * k + j] (a
    MoE layer's k expert outputs), plus `extra` [T, D] where given (its shared experts' output).
    The norm that adds it to the stream sums it in its kernel on CUDA, which saves decode a
    launch per layer (two with shared experts); elsewhere `total` sums it first."""

    rows: torch.Tensor  # [T * k, D]
    weights: torch.Tensor  # [T, k]
    extra: torch.Tensor | None = None  # [T, D]

    def total(self) -> torch.Tensor:
        """The sum as a tensor [T, D] (float32)."""
        t, k = self.weights.shape
        w = self.weights.float().view(t, 1, k)
        y = torch.bmm(w, self.rows.float().view(t, k, -1)).view(t, -1)
        return y if self.extra is None else y + self.extra.float().reshape(t, -1)


def _cuda32(*xs: torch.Tensor) -> bool:
    return all(x.is_cuda and x.dtype == torch.float32 for x in xs)


def _quant(x: torch.Tensor) -> bool:
    return x.reshape(-1, x.shape[-1]).shape[0] <= QUANT_MAX_ROWS


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * w over the last dim, float32."""
    return rms_norm_q(x, w, eps, quant=False)[0]


def rms_norm_q(x: torch.Tensor, w: torch.Tensor, eps: float, quant: bool = True, shrink=None):
    """(rms_norm(x), its quantized rows or None); `shrink` (a `lora_delta.LoraShrink`): the
    next linear's LoRA shrink, written into its scratch by the same kernel."""
    if _cuda32(x):
        from localllm.kernels.fused.triton_ops import rms_norm_cuda

        return rms_norm_cuda(x, w, eps, quant and _quant(x), shrink)
    y = F.rms_norm(x, w.shape, w, eps)
    if shrink is not None:
        shrink.reference(y)
    return y, None


def add_rms_norm(
    x: torch.Tensor, r: "torch.Tensor | WeightedRows", w: torch.Tensor, eps: float,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x + scale * r, its rms_norm): the residual stream and the next sub-layer's input."""
    return add_rms_norm_q(x, r, w, eps, quant=False, scale=scale)[:2]


def add_rms_norm_q(
    x: torch.Tensor,
    r: "torch.Tensor | WeightedRows",
    w: torch.Tensor,
    eps: float,
    quant: bool = True,
    max_rows: int = QUANT_MAX_ROWS,
    shrink=None,
    scale: float = 1.0,
):
    """(x + scale * r, its rms_norm, the norm's quantized rows or None); `max_rows`: the
    reader's row limit (a GEMV's, or any number for MoE experts' grouped GEMMs). `r` may be a
    `WeightedRows` (the kernel sums it). `shrink`: as `rms_norm_q`'s. `scale`: a residual
    scale (Granite's); off CUDA x.add(r, alpha=scale), the unfused blocks' very op."""
    rw = re = None
    if isinstance(r, WeightedRows):
        on = _cuda32(x, r.rows) and (r.extra is None or _cuda32(r.extra))
        r, rw, re = (r.rows, r.weights, r.extra) if on else (r.total().to(x.dtype), None, None)
    if _cuda32(x, r):
        from localllm.kernels.fused.triton_ops import add_rms_norm_cuda

        rows = x.reshape(-1, x.shape[-1]).shape[0]
        quant = quant and rows <= max_rows
        return add_rms_norm_cuda(x, r, w, eps, quant, rw=rw, shrink=shrink, scale=scale, re=re)
    s = x + r if scale == 1.0 else x.add(r, alpha=scale)
    y = F.rms_norm(s, w.shape, w, eps)
    if shrink is not None:
        shrink.reference(y)
    return s, y, None


def gated_add(x: torch.Tensor, y: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x + y + sigmoid(g) * s: x, y, s [T, D], g [T, 1] (Qwen3-Next's block end: the residual,
    the routed experts, the shared expert under its gate); one launch on CUDA float32."""
    if _cuda32(x, y, s, g):
        from localllm.kernels.fused.triton_ops import gated_add_cuda

        return gated_add_cuda(x, y, s, g)
    return x + y + torch.sigmoid(g) * s


def gated_add_dot(x, y, s, h, gw) -> torch.Tensor:
    """`gated_add` with the gate's logits h @ gw.T (h [T, D], gw [1, D]: Qwen3-Next's shared
    expert gate) made in the same launch on CUDA float32; elsewhere the unfused ops."""
    if _cuda32(x, y, s, h, gw):
        from localllm.kernels.fused.triton_ops import gated_add_cuda

        return gated_add_cuda(x, y, s, gw, h)
    return gated_add(x, y, s, h.float() @ gw.t())


def silu_mul(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    """silu(g) * u for gu = [g | u] side by side in the last dim ([..., 2 * hidden])."""
    return silu_mul_q(gu, hidden, quant=False)[0]


def silu_mul_q(
    gu: torch.Tensor, hidden: int, quant: bool = True, max_rows: int = QUANT_MAX_ROWS, shrink=None
):
    """(silu_mul(gu), its quantized rows or None); `max_rows`: the reader's row limit;
    `shrink`: as `rms_norm_q`'s."""
    if _cuda32(gu):
        from localllm.kernels.fused.triton_ops import silu_mul_cuda

        rows = gu.reshape(-1, gu.shape[-1]).shape[0]
        return silu_mul_cuda(gu, hidden, quant and rows <= max_rows, shrink)
    g, u = gu.split(hidden, dim=-1)
    y = F.silu(g) * u
    if shrink is not None:
        shrink.reference(y)
    return y, None
