"""The end of a Mamba-2 mixer (Granite 4.0-H, Bamba): the scan's output plus the D skip, gated
by SiLU(z), RMS-normalised per group of channels and scaled by the norm's weight:

    y' = (y + D_h x) * silu(z)        per head h of P channels
    out = y' / sqrt(mean_group(y'^2) + eps) * w

`skip_gate_norm_ref` is the torch form (ten passes over the rows); on CUDA `skip_gate_norm`
runs it as one Triton launch (`triton_gated_norm`), reading x and z where the mixer's
projection left them (strided column slices) and writing the output in the caller's dtype.
"""

import torch


def use_triton(y: torch.Tensor) -> bool:
    """Whether the fused kernel runs: on CUDA (a test sets it under TRITON_INTERPRET=1)."""
    return y.is_cuda


def skip_gate_norm_ref(y, x, D, z, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """y and x [T, H, P] (float32 y), D [H], z [T, H * P], weight [G, H * P / G] -> [T, H * P]
    in `dtype`."""
    t, g = y.shape[0], weight.shape[0]
    out = (y + D[:, None] * x).reshape(t, -1) * torch.nn.functional.silu(z)
    out = out.reshape(t, g, -1)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps) * weight
    return out.reshape(t, -1).to(dtype)


def skip_gate_norm(y, x, D, z, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`skip_gate_norm_ref`; on CUDA one Triton launch."""
    if use_triton(y):
        from localllm.kernels.recurrent.triton_gated_norm import skip_gate_norm_triton

        return skip_gate_norm_triton(y, x, D, z, weight, eps, dtype)
    return skip_gate_norm_ref(y, x, D, z, weight, eps, dtype)


def skip_gate_norm_q(y, x, D, z, weight, eps: float, dtype: torch.dtype, quant: bool):
    """(`skip_gate_norm`, its int8 rows for the out-projection's GEMV or None); on CUDA, with
    `quant`, both from one launch."""
    if use_triton(y):
        from localllm.kernels.recurrent.triton_gated_norm import skip_gate_norm_triton

        if quant:
            return skip_gate_norm_triton(y, x, D, z, weight, eps, dtype, quant=True)
        return skip_gate_norm_triton(y, x, D, z, weight, eps, dtype), None
    return skip_gate_norm_ref(y, x, D, z, weight, eps, dtype), None
