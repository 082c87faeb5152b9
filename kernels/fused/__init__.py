"""Fused elementwise steps of a decoder layer (RMSNorm with the residual add, SiLU-gated product):
plain-torch references here, triton kernels in `triton_ops` (imported only on CUDA)."""

from localllm.kernels.fused.ops import add_rms_norm, rms_norm, silu_mul

__all__ = ["add_rms_norm", "rms_norm", "silu_mul"]
