"""Linears on the CPU through the native kernels (`kernels/cpu/block_linear.c`), holding the
file's blocks alone: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, Q4_K, Q5_K and Q6_K (keep-quant:
the fp16 copies they replace took 2 bytes a weight, the int4pack forms 0.875 plus scales). A fused
projection (q/k/v, gate/up) keeps its tensors as parts where the file has them, never stacked.

Decode-sized calls (up to NATIVE_MAX_T rows for Q4_K / Q6_K / Q8_0, 16 for the others)
multiply int8 activations (per 256 values for Q4_K and Q5_K, per 32 for the others, as
llama.cpp's decode does) and read each weight row once for all rows. Longer calls (prompts)
decode row tiles to ggml's float32 values in C for an exact fp32 GEMM: exact prompt math is
what keeps teacher-forced logits as close to llama.cpp's as transformers' are
(tests/perf/results/cpu-moe.md, "CPU-only MoE next to llama.cpp").
`block_rows_reference` is the torch reference of the int8 path, `quant_matmul_reference`
(kernels/quant/linear.py) of the prompt path.
"""

import torch
import torch.nn.functional as F

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.tiles import row_tiles
from localllm.kernels.quant.types import QuantType

# the types `kernels/cpu/block_linear.c` multiplies (this module never imports it: the kernels
# object comes from the loader, so importing kernels.quant never builds or loads C)
NATIVE_TYPES = frozenset(
    QuantType[n]
    for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K")
)
MAX_PARTS = 8  # parts of one weight (MAX_PARTS in the C)
# Rows per call on the int8 kernels (decode, batched decode, short prompts). This 2-core Xeon, one
# 4608 x 2048 / 2048 x 4096 matrix, ms per call at 16 / 32 / 64 / 96 rows: Q4_K int8 rows 1.86 /
# 3.64 / 7.15 / 10.64 against C-decoded tiles + fp32 GEMM 1.84* / 7.68 / 9.07 / 9.93 (*: rows);
# Q6_K 2.17 / 4.19 / 8.07 / 12.91 against 11.30 / 11.90 / 15.78 at 32 / 64 / 96.
NATIVE_MAX_T = 64
# The types new to these kernels (their torch paths before: an int4pack form at ~3e-3 relative
# error, fp16 copies at ~3e-4) take the int8 rows up to batched decode's 16 rows only: longer
# calls are prompts and scoring, which keep exact float32 rows. (With 64, one of SmolLM2 Q4_1's
# teacher-forced golden prompts of 53 tokens put llama.cpp's token 0.65 nats below our best.)
EXACT_FROM_T = {QuantType.Q4_K: NATIVE_MAX_T + 1, QuantType.Q6_K: NATIVE_MAX_T + 1,
                QuantType.Q8_0: NATIVE_MAX_T + 1}  # fmt: skip
EXACT_FROM_T_NEW = 17


class NativeLinear:
    kind = "native"

    def __init__(self, parts: list[torch.Tensor], qtype: QuantType, shape: tuple[int, int],
                 kernels):  # fmt: skip
        """`kernels`: a `kernels.cpu.block_linear.BlockKernels`."""
        # the mmap views as they are: no copy (contiguous rows of raw blocks)
        self.parts = kernels.parts([p.reshape(p.shape[0], -1) for p in parts])
        if self.parts.n != shape[0]:
            raise ValueError(f"parts of {self.parts.n} rows for a {shape} weight")
        self.qtype, self.shape, self.kernels = QuantType(qtype), shape, kernels
        self.exact_from_t = EXACT_FROM_T.get(self.qtype, EXACT_FROM_T_NEW)

    @property
    def data(self) -> torch.Tensor:
        """The blocks of a one-part weight (tests, tools)."""
        return self.parts.parts[0]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if x2.shape[0] < self.exact_from_t:
            y = self.kernels.rows(self.parts, self.qtype, k, x2)
        else:
            y = torch.empty(x2.shape[0], n)
            for r0, r1 in row_tiles(n, k):
                w = self.kernels.dequant(self.parts, self.qtype, k, r0, r1)
                y[:, r0:r1] = F.linear(x2, w)
        return y.reshape(*x.shape[:-1], n)


def activation_group(qtype: QuantType) -> int:
    """Values per int8 activation scale: 256 for Q4_K and Q5_K (llama.cpp's Q8_K), else 32."""
    return 256 if QuantType(qtype) in (QuantType.Q4_K, QuantType.Q5_K) else 32


def block_rows_reference(x: torch.Tensor, parts: list[torch.Tensor], qtype: QuantType,
                         k: int) -> torch.Tensor:  # fmt: skip
    """The int8 path's math in torch: x [t, k] rounded to int8 codes per `activation_group`
    (scale amax / 127, as the C), times the gguf-dequantized parts stacked, float64 [t, n]."""
    g = x.float().reshape(x.shape[0], -1, activation_group(qtype))
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv)  # lrintf: to nearest, ties to even
    xq = (q.double() * (amax / 127.0).double()).reshape(x.shape[0], k)
    w = torch.cat([dequantize(p, qtype).reshape(-1, k) for p in parts]).double()
    return xq @ w.T
