"""Q6_K and Q8_0 linears on the CPU through the native kernels (`kernels/cpu/moe_gemv.c`),
holding the file's blocks alone (keep-quant: the fp16 copy they replace took 2 bytes a weight).

Decode-sized calls (up to NATIVE_MAX_T rows) multiply int8 activations (per 32 values for these
types, as llama.cpp's decode does for Q8_0) and read each weight row once for all rows. Longer
calls (prompts) decode row tiles to ggml's float32 values in C for an exact fp32 GEMM: exact
prompt math is what keeps teacher-forced logits as close to llama.cpp's as transformers' are
(tests/perf/RESULTS.md, "CPU-only MoE next to llama.cpp").
"""

import torch
import torch.nn.functional as F

from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType

NATIVE_TYPES = frozenset({QuantType.Q6_K, QuantType.Q8_0})
NATIVE_MAX_T = 16  # rows per call on the int8 kernels: decode, batched decode of 16 sequences


class NativeLinear:
    kind = "native"

    def __init__(self, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int], kernels):
        self.data = data.reshape(shape[0], -1).contiguous()  # the mmap view: no copy
        self.qtype, self.shape, self.kernels = QuantType(qtype), shape, kernels

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x2 = x.reshape(-1, k).float()
        if x2.shape[0] <= NATIVE_MAX_T:
            y = self.kernels.gemm_rows(self.data, self.qtype, n, k, x2)
        else:
            y = torch.empty(x2.shape[0], n)
            for r0, r1 in row_tiles(n, k):
                w = self.kernels.dequantize(self.data[r0:r1], self.qtype, k)
                y[:, r0:r1] = F.linear(x2, w)
        return y.reshape(*x.shape[:-1], n)
