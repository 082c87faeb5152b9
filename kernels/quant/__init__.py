"""GGUF (ggml) quantization formats: the block table, torch dequant references, keep-quant matmul."""

from .types import QuantType, block_geometry, row_nbytes

__all__ = ["QuantType", "block_geometry", "row_nbytes"]
