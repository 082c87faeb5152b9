"""F16 and BF16 weights multiplied in their own dtype: the CUDA strategy `half_gemm`.

The file's half values are the weight (a view of the raw blocks, no copy, no per-call float32
tile). A call casts the activations to the weight's dtype and runs one cuBLAS GEMM on tensor
cores with float32 accumulation and a float32 output (`torch.mm(..., out_dtype=float32)`, torch
>= 2.8; before, the half output is widened). On a CPU (never chosen there, tests only) the same
rounded inputs are summed in float32. llama.cpp does the same for an F16 or BF16
weight on CUDA (`ggml_cuda_mul_mat_cublas`: activations converted to the weight's type; it
accumulates F16 in f16, BF16 in f32).

F16 range: activations beyond +-65504 saturate there (one extra elementwise op on the half
copy; llama.cpp's cast makes them inf, then NaN). Checking and falling back to float32 as the CPU
strategy does (`linear_dense.DenseHalfLinear`) needs a host sync per call, which CUDA graphs
cannot hold. `precise=True` keeps the exact float32 path; BF16 has float32's range.
`half_input` and `half_matmul_reference` are the torch references the GPU tests compare with.
"""

import torch
import torch.nn.functional as F

from localllm.kernels.quant.types import QuantType

HALF_DTYPES = {QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}
F16_MAX = 65504.0  # float16's largest finite value
# cuBLAS writes float32 straight from the half GEMM (no f16 output to overflow, no widening op)
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def half_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` (float16: saturated at +-65504 instead of inf); NaN stays NaN. A new tensor
    where x is of another dtype; x itself is never written."""
    h = x.to(dtype)
    if dtype != torch.float16:
        return h
    return h.clamp(-F16_MAX, F16_MAX) if h is x else h.clamp_(-F16_MAX, F16_MAX)


class HalfGemmLinear:
    """W [N, K] as the file stores it (F16 or BF16); float32 [T, K] in, float32 [T, N] out."""

    kind = "half_gemm"

    def __init__(self, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int]):
        n, k = shape
        qtype = QuantType(qtype)
        if qtype not in HALF_DTYPES:
            raise ValueError(f"half_gemm takes F16 or BF16 weights, not {qtype.name}")
        # a view of the raw bytes (contiguous uploads and stacks: no copy)
        self.w = data.reshape(n, 2 * k).contiguous().view(HALF_DTYPES[qtype])
        self.shape = (n, k)

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return self.w.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = half_input(x.reshape(-1, self.shape[1]), self.w.dtype)
        if not x2.is_cuda:  # (tests: what cuBLAS computes, float32 sums of the half values)
            y = F.linear(x2.float(), self.w.float())
        elif _MM_OUT_DTYPE:
            y = torch.mm(x2, self.w.t(), out_dtype=torch.float32)
        else:  # torch < 2.8: a half output, widened
            y = F.linear(x2, self.w).float()
        return y.reshape(*x.shape[:-1], self.shape[0])


def half_matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What `HalfGemmLinear` computes, in float64: the rounded half inputs, exact sums."""
    return (half_input(x, w.dtype).double() @ w.double().T).float()
