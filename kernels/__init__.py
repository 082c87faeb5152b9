"""Device math for localllm: dequantization, quantized matmul, attention, norms, rope, sampling ops.

Every op has a plain-torch reference and, where it pays, fast variants. No model, request or file
concepts live here: inputs are tensors and quant types.
"""
