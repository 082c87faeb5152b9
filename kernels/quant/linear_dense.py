"""The non-int4 CPU strategies: a dense half-precision copy, per-call dequant tiles, plain float.

- DenseHalfLinear: W dequantized once to fp16 (or bf16), 2 bytes/weight. Small T: half GEMV
  (torch's CPU kernels accumulate in fp32). Large T: half row tiles widened to fp32 for an fp32
  GEMM, much faster than half GEMM on CPUs without native bf16/fp16 dot products.
  fp16 is preferred: 15 % faster than bf16 here and 8x more precise (11 significant bits). Its
  range is guarded: weights that do not fit fp16 are kept in bf16, and a call whose activations
  could overflow fp16 (max|x| * max row L1 norm of W) takes the fp32 path.
- DequantTilesLinear: keeps only the raw ggml blocks and dequantizes row tiles on every call
  (exact, works for every type and device; the keep-quant fallback).
- Float32Linear: F32 weights, used as they are.
"""

import contextlib

import torch
import torch.nn.functional as F

from localllm.kernels.cpu.onednn_fp32 import fast_fp32
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType

F16_SAFE = 30000.0  # stay well inside fp16's 65504 for activations and outputs
_NATIVE = {QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}
# Weights up to this size are widened whole for a prompt-sized call (64 MiB of fp32 scratch):
# per-tile GEMMs and their strided output copies cost ~2x at T = 1024 (Zen 4, 2 threads;
# tests/perf/results/vision.md); larger weights (output heads) keep the bounded row tiles.
WHOLE_FP32_ELEMENTS = 1 << 24


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


def _half_copy(data, qtype, shape, dtype) -> torch.Tensor | None:
    """Dequantize to `dtype` in row tiles (bounded fp32 scratch); None if fp16 cannot hold W."""
    n, k = shape
    w = torch.empty(n, k, dtype=dtype, device=data.device)
    for r0, r1 in row_tiles(n, k):
        tile = dequantize(data[r0:r1], qtype).reshape(r1 - r0, k)
        if dtype == torch.float16 and not tile.abs().amax() < F16_SAFE:
            return None
        w[r0:r1] = tile
    return w


class DenseHalfLinear:
    """W as a dense fp16 (preferred) or bf16 copy; `kind` says which one was kept."""

    def __init__(self, data, qtype: QuantType, shape: tuple[int, int], fp32_from_t, dtype):
        n, k = shape
        qtype = QuantType(qtype)
        if qtype in _NATIVE:  # the file's own half values: a view, no copy
            self.w = data.reshape(n, 2 * k).contiguous().view(_NATIVE[qtype])
        else:
            w = _half_copy(data, qtype, shape, dtype)
            self.w = w if w is not None else _half_copy(data, qtype, shape, torch.bfloat16)
        self.shape = (n, k)
        self.fp32_from_t = fp32_from_t  # calls with at least this many rows run fp32 tiles
        # |y| <= max|x| * max_n sum_k |w[n, k]|: one scalar bounds every output of a call
        self.row_l1_max = max(
            (self.w[r0:r1].float().abs().sum(1).amax().item() for r0, r1 in row_tiles(n, k)),
            default=0.0,
        )

    @property
    def kind(self) -> str:
        return "dense_f16" if self.w.dtype == torch.float16 else "dense_bf16"

    @property
    def nbytes(self) -> int:
        return self.w.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # few torch ops on the decode path: each costs ~5 us here
            return self.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.shape[0])
        if x.shape[0] >= self.fp32_from_t:
            return self.matmul_fp32_tiles(x)
        return self.matmul_half(x)

    def matmul_half(self, x: torch.Tensor) -> torch.Tensor:
        if self.w.dtype == torch.float16:
            xmax = torch.linalg.vector_norm(x, float("inf")).item()
            if not (xmax < F16_SAFE and xmax * self.row_l1_max < F16_SAFE):
                return self.matmul_fp32_tiles(x)  # fp16 could overflow (or x is not finite)
        return F.linear(x.to(self.w.dtype), self.w).float()

    def matmul_fp32_tiles(self, x: torch.Tensor) -> torch.Tensor:
        # on a CPU through oneDNN where that is float32 math (`onednn_fp32`: a bf16 folder's
        # pp512 1.78-1.82x, a SigLIP tower 1.74x on the 2026-12-06 Zen 5)
        with fast_fp32() if x.device.type == "cpu" else contextlib.nullcontext():
            return self._fp32_tiles(x)

    def _fp32_tiles(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x = x.float()
        if n * k <= WHOLE_FP32_ELEMENTS:  # one GEMM: ~2x faster than tiles at T >= 1024
            return F.linear(x, self.w.float())
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
