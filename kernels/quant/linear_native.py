"""Q4_K, Q6_K and Q8_0 linears on the CPU through the native kernels (`kernels/cpu/moe_gemv.c`),
holding the file's blocks alone (keep-quant: the fp16 copy they replace took 2 bytes a weight,
Q4_K's int4pack form 0.875).

Decode-sized calls (up to NATIVE_MAX_T rows) multiply int8 activations (per 256 values for
Q4_K, per 32 for the others, as llama.cpp's decode does) and read each weight row once for all
rows. Longer calls (prompts) decode row tiles to ggml's float32 values in C for an exact fp32
GEMM: exact prompt math is what keeps teacher-forced logits as close to llama.cpp's as
transformers' are (tests/perf/results/cpu-moe.md, "CPU-only MoE next to llama.cpp").
"""

import torch
import torch.nn.functional as F

from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType

NATIVE_TYPES = frozenset({QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0})
# Rows per call on the int8 kernels (decode, batched decode, short prompts). This 2-core Xeon, one
# 4608 x 2048 / 2048 x 4096 matrix, ms per call at 16 / 32 / 64 / 96 rows: Q4_K int8 rows 1.86 /
# 3.64 / 7.15 / 10.64 against C-decoded tiles + fp32 GEMM 1.84* / 7.68 / 9.07 / 9.93 (*: rows);
# Q6_K 2.17 / 4.19 / 8.07 / 12.91 against 11.30 / 11.90 / 15.78 at 32 / 64 / 96.
NATIVE_MAX_T = 64


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
