"""Plain-torch oracles of the dp4a kernels' arithmetic (`triton_packed`, `triton_dp4a`): float
activations rounded to int8 codes per 32 values, and a GEMV of those codes against the
gguf-dequantized weight in float64. Free of triton, so they run (and are tested) anywhere."""

import torch

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.types import QuantType


def quantize_x8_reference(x: torch.Tensor) -> torch.Tensor:
    """The values the kernels multiply by: x rounded to int8 codes per 32 (float64 [M, K])."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: torch computes `127.0 / amax` as 127 * (1 / amax), an ulp
    # off the kernels' correctly rounded division, which flipped codes at near-halves (H200)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.floor(g * inv + 0.5).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def gemv_q8x_reference(x: torch.Tensor, data: torch.Tensor, qtype: QuantType, n: int, k: int):
    """Oracle of `gemv_packed`: quantized x times the gguf-dequantized W, float64."""
    w = dequantize(data.cpu(), qtype).reshape(n, k).double()
    return quantize_x8_reference(x.cpu()) @ w.T
