"""Plain-torch references of the fused decoder steps; on CUDA tensors they run the triton kernels
of `triton_ops` (one launch each instead of 2-6 eager kernels; decode on a GPU is launch-bound
once the GEMVs are fast)."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * w over the last dim, float32."""
    if x.is_cuda and x.dtype == torch.float32:
        from localllm.kernels.fused.triton_ops import rms_norm_cuda

        return rms_norm_cuda(x, w, eps)
    return F.rms_norm(x, w.shape, w, eps)


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, rms_norm(x + r)): the residual stream and the next sub-layer's input."""
    if x.is_cuda and x.dtype == torch.float32 and r.dtype == torch.float32:
        from localllm.kernels.fused.triton_ops import add_rms_norm_cuda

        return add_rms_norm_cuda(x, r, w, eps)
    s = x + r
    return s, F.rms_norm(s, w.shape, w, eps)


def silu_mul(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    """silu(g) * u for gu = [g | u] side by side in the last dim ([..., 2 * hidden])."""
    if gu.is_cuda and gu.dtype == torch.float32:
        from localllm.kernels.fused.triton_ops import silu_mul_cuda

        return silu_mul_cuda(gu, hidden)
    g, u = gu.split(hidden, dim=-1)
    return F.silu(g) * u
