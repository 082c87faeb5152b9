"""Fused elementwise steps of a decoder layer (RMSNorm with the residual add, SiLU-gated product,
the attention prologue in `rope_qkv`): plain-torch references here, triton kernels in
`triton_ops` / `triton_rope` (imported only on CUDA)."""

from localllm.kernels.fused.ops import (
    QUANT_MAX_ROWS,
    WeightedRows,
    add_rms_norm,
    add_rms_norm_q,
    rms_norm,
    rms_norm_q,
    silu_mul,
    silu_mul_q,
)

__all__ = [
    "QUANT_MAX_ROWS",
    "WeightedRows",
    "add_rms_norm",
    "add_rms_norm_q",
    "rms_norm",
    "rms_norm_q",
    "silu_mul",
    "silu_mul_q",
]
