"""GGUF (ggml) quantization formats: the block table, torch dequant references, keep-quant
matmul."""

from localllm.kernels.quant.dequant import DEQUANT_TYPES, dequantize
from localllm.kernels.quant.linear import PreparedLinear, prepare_linear, quant_matmul_reference
from localllm.kernels.quant.types import QuantType, block_geometry, row_nbytes

__all__ = [
    "DEQUANT_TYPES",
    "PreparedLinear",
    "QuantType",
    "block_geometry",
    "dequantize",
    "prepare_linear",
    "quant_matmul_reference",
    "row_nbytes",
]
