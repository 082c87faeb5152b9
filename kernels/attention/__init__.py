"""Attention over a paged KV cache: plain-torch reference ops (triton variants plug in on GPU)."""

from localllm.kernels.attention.decode import decode_attention, quantized_output, serves_every_row
from localllm.kernels.attention.decode_plan import DecodePlan, plan_decode
from localllm.kernels.attention.kv_quant import (
    KV_DTYPES,
    decode_kv,
    dequantize_fp8,
    dequantize_q8_0,
    encode_kv,
    q8_group,
    quantize_fp8,
    quantize_q8_0,
    scale_shape,
    vector_nbytes,
)
from localllm.kernels.attention.paged import context_attention, paged_attention, write_paged

__all__ = [
    "KV_DTYPES",
    "DecodePlan",
    "context_attention",
    "decode_attention",
    "decode_kv",
    "dequantize_fp8",
    "dequantize_q8_0",
    "encode_kv",
    "paged_attention",
    "plan_decode",
    "q8_group",
    "quantize_fp8",
    "quantize_q8_0",
    "quantized_output",
    "scale_shape",
    "serves_every_row",
    "vector_nbytes",
    "write_paged",
]
