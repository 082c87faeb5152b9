"""The check every fused kernel's int8 rows take: exactly what `quantize_x8` makes of the float
rows they came with, so the dp4a GEMV that reads them computes what it would from the floats."""

import torch


def assert_int8_rows_of(xq, y: torch.Tensor) -> None:
    """`xq` (a `QuantizedX`) is `quantize_x8(y)` field for field, bit for bit."""
    from localllm.kernels.quant.triton_packed import quantize_x8

    want = quantize_x8(y)
    for f in ("words", "scale", "sum16", "xsum"):
        assert torch.equal(getattr(xq, f), getattr(want, f)), f
