"""The non-int4 CPU strategies: a dense bf16 copy, per-call dequant tiles, and plain float.

- DenseBf16Linear: W dequantized once to bf16 (2 bytes/weight). Small T: bf16 GEMV (torch's fast
  CPU path; bf16 rounding of x and W). Large T: bf16 row tiles widened to fp32 for an fp32 GEMM,
  which is much faster than bf16 GEMM on CPUs without native bf16 dot products.
- DequantTilesLinear: keeps only the raw ggml blocks and dequantizes row tiles on every call
  (exact, works for every type and device; the keep-quant fallback).
- Float32Linear: F32 weights, used as they are.
"""

import torch
import torch.nn.functional as F

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


class DenseBf16Linear:
    kind = "dense_bf16"

    def __init__(self, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int], fp32_from_t):
        n, k = shape
        if QuantType(qtype) == QuantType.BF16:
            self.w = data.reshape(n, 2 * k).contiguous().view(torch.bfloat16)  # no copy needed
        else:
            self.w = torch.empty(n, k, dtype=torch.bfloat16, device=data.device)
            for r0, r1 in row_tiles(n, k):  # bounded fp32 scratch at load
                self.w[r0:r1] = dequantize(data[r0:r1], qtype).reshape(r1 - r0, k)
        self.shape = (n, k)
        self.fp32_from_t = fp32_from_t  # calls with at least this many rows run fp32 tiles

    @property
    def nbytes(self) -> int:
        return self.w.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # few torch ops on the decode path: each costs ~5 us here
            return self.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.shape[0])
        if x.shape[0] >= self.fp32_from_t:
            return self.matmul_fp32_tiles(x)
        return self.matmul_bf16(x)

    def matmul_bf16(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.w).float()

    def matmul_fp32_tiles(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x = x.float()
        out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for r0, r1 in row_tiles(n, k):
            out[:, r0:r1] = F.linear(x, self.w[r0:r1].float())
        return out


class DequantTilesLinear:
    kind = "dequant_tiles"

    def __init__(self, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int]):
        self.data, self.qtype, self.shape = data.reshape(shape[0], -1), QuantType(qtype), shape

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _flat(x)
        n, k = self.shape
        out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x2.device)
        for r0, r1 in row_tiles(n, k):
            w = dequantize(self.data[r0:r1], self.qtype).reshape(r1 - r0, k)
            out[:, r0:r1] = F.linear(x2, w)
        return out.reshape(*x.shape[:-1], n)


class Float32Linear:
    kind = "dense_f32"

    def __init__(self, w: torch.Tensor):
        self.w = w  # float32 [N, K]; for F32 weights this is a view of the raw data

    @property
    def nbytes(self) -> int:
        return self.w.numel() * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x if x.dtype == torch.float32 else x.float(), self.w)
