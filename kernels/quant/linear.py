"""Keep-quant linear layers: `prepare_linear` picks, per ggml type and device, how a weight is
held and multiplied; `quant_matmul_reference` is the plain-torch oracle.

CPU policy, chosen by measurement on a 2-core Zen 3 (tests/perf/results/cpu.md, "Quant linear on
CPU"; tests/perf/bench_quant_linear.py):
- Q4_0/Q4_1/Q4_K: int4pack, 0.875 B/weight. T < 64: torch's int4 kernel with bf16 x (fastest
  GEMV, ~3e-3 relative error); T >= 64: unpack to fp32 tiles (= gguf dequant) + fp32 GEMM.
- Q5_*/Q8_0/Q6_K: an fp16 copy (bf16 if out of range), 2 B/weight, ~3e-4 relative error;
  F16/BF16 files are used as they are. T < 8: half GEMV; T >= 8: fp32 GEMM on widened tiles.
  Where the native CPU kernels load, every type they know (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, IQ4_NL/IQ4_XS
  and Q4_K/Q5_K/Q6_K) keeps its blocks instead (`linear_native`: int8 dots for decode, exact fp32
  tiles decoded in C for prompts; a fused projection's parts where the file has them).
- F32 as is; every other type keeps its raw blocks and dequantizes row tiles per call.
CUDA policy: Q8_0/Q4_0/IQ4_NL/MXFP4/IQ4_XS/Q4_K/Q5_K/Q6_K run triton kernels through
`triton_linear` (triton is imported only then): Q4_K/Q6_K/Q8_0 re-laid out column-major once
(`repack`) for the int8-activation dp4a GEMVs of `triton_dp4a`, the others on their raw blocks
(`triton_gemv`); prefill dequantizes to bf16 for a GEMM. F16/BF16 multiply in their own dtype
on tensor cores, the file's values as the weight (`linear_half`: activations cast to it, float32
accumulation and output; HALF_GEMM off: float32 row tiles per call). F32 as is; other types
dequantize row tiles per call.
Float32 in, float32 out. `precise=True` takes the exact path (dequantize + fp32 matmul values).
"""

from types import MappingProxyType
from typing import Protocol

import torch

from localllm.kernels.quant.affine import CODE_BITS
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.linear_dense import DenseHalfLinear, DequantTilesLinear, Float32Linear
from localllm.kernels.quant.linear_half import HALF_DTYPES, HalfGemmLinear
from localllm.kernels.quant.linear_int4 import Int4PackLinear
from localllm.kernels.quant.linear_native import MAX_PARTS, NATIVE_TYPES, NativeLinear
from localllm.kernels.quant.types import QuantType, block_geometry
from localllm.kernels.quant.widen import WIDENED, widen_blocks, widened_type

# Calls with at least this many rows leave the bf16/fp16 kernels for fp32 GEMM on row tiles
# decoded per call (Zen 3 has no half-precision dot product: half GEMM is slower than fp32).
INT4_EXACT_FROM_T = 64  # int4pack: unpacking costs ~1.2 ms per 1M weights; measured crossover 48-64
HALF_FP32_FROM_T = 8  # dense fp16/bf16: widening to fp32 is cheap

# CPU strategy per type; types not listed use "dequant_tiles" (exact, keeps the raw blocks).
POLICY: MappingProxyType[QuantType, str] = MappingProxyType(
    {
        QuantType.F32: "dense_f32",
        QuantType.BF16: "dense_bf16",
        QuantType.Q4_0: "int4pack",
        QuantType.Q4_1: "int4pack",
        QuantType.Q4_K: "int4pack",
        QuantType.F16: "dense_f16",
        QuantType.Q5_0: "dense_f16",
        QuantType.Q5_1: "dense_f16",
        QuantType.Q5_K: "dense_f16",
        QuantType.Q8_0: "dense_f16",
        QuantType.Q6_K: "dense_f16",
    }
)
# F16/BF16 weights on CUDA through `half_gemm` (the file's half values on tensor cores, as
# llama.cpp's cuBLAS path) instead of float32 dequant tiles per call. On since its GPU run (H100,
# 2026-12-07 04:37 UTC, tests/perf/results/vision.md): its GPU tests pass, an F16 SmolLM2-shape
# decodes 1.53x and prefills ~2.3x the float32 tiles, the SigLIP tower's linears ~10x
HALF_GEMM = True
STRATEGIES = (
    "int4pack", "dense_f16", "dense_bf16", "dequant_tiles", "dense_f32", "triton", "half_gemm",
)  # fmt: skip
# Types with triton kernels (`triton_linear.SUPPORTED`; kept here so CPU code never imports triton).
TRITON_TYPES = frozenset(
    {
        *(QuantType.Q8_0, QuantType.Q4_0, QuantType.IQ4_NL, QuantType.MXFP4, QuantType.IQ4_XS),
        *(QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K),
    }
)

# Types the triton path takes widened to Q8_0 (`widen`: exact; llama.cpp's Q4_K_M writes Q5_0 where
# rows are no whole K block, as GLM-4.5-Air's 1408-wide shared expert's ffn_down); with
# widen.NATIVE_Q5_0 packed as stored instead (its 9-64-row batches then take the bf16 path)
TRITON_WIDENED = frozenset({QuantType.Q5_0})


class PreparedLinear(Protocol):
    """A weight [N, K] ready for y = x @ W.T: float32 [..., K] -> float32 [..., N]."""

    kind: str  # the strategy, e.g. "int4pack1", "dense_bf16", "dequant_tiles"
    nbytes: int  # bytes held by this object (views of the caller's raw data included)

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


def choose_strategy(qtype: QuantType, shape: tuple[int, int], device: torch.device) -> str:
    """The default strategy for a weight (see POLICY and the CUDA policy above)."""
    qtype = QuantType(qtype)
    dev = torch.device(device).type
    if dev == "cuda" and (qtype in TRITON_TYPES or qtype in TRITON_WIDENED):
        return "triton"
    if dev == "cuda" and qtype in HALF_DTYPES and HALF_GEMM:
        return "half_gemm"
    if dev != "cpu":
        return "dense_f32" if qtype == QuantType.F32 else "dequant_tiles"
    strategy = POLICY.get(qtype, "dequant_tiles")
    if strategy == "int4pack" and (shape[0] % 16 or shape[1] % 32):
        return "dense_f16"
    return strategy


def prepare_linear(
    data: torch.Tensor,
    qtype: QuantType,
    shape: tuple[int, int],
    precise: bool = False,
    strategy: str | None = None,
    native=None,
) -> PreparedLinear:
    """Prepare raw ggml blocks (uint8 [N, row_bytes]) of a weight of logical shape (N, K).

    `strategy` overrides the policy (benchmarks, tests). With `precise`, results equal
    dequantize + fp32 matmul up to fp32 summation order. `native`: the loaded native CPU kernels
    (`kernels.cpu.native`), which then take the types they know on their blocks (in place of
    an int4pack form, an fp16 copy or per-call torch tiles).
    """
    qtype, shape = QuantType(qtype), (int(shape[0]), int(shape[1]))
    block, nbytes = block_geometry(qtype)
    if data.dtype != torch.uint8 or data.numel() != shape[0] * shape[1] // block * nbytes:
        raise ValueError(f"{qtype.name} data {tuple(data.shape)} does not hold a {shape} weight")
    data = data.reshape(shape[0], -1)
    chosen = strategy is None  # (a strategy given by a benchmark or test is taken as given)
    strategy = strategy or choose_strategy(qtype, shape, data.device)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")
    if precise and strategy in ("dense_f16", "dense_bf16", "triton", "half_gemm"):
        strategy = "dense_f32" if qtype == QuantType.F32 else "dequant_tiles"
    if chosen and data.device.type == "cpu" and strategy != "dense_f32":
        kept = prepare_parts([data], qtype, shape, precise, native)
        if kept is not None:
            return kept
    if strategy == "int4pack":
        if qtype not in CODE_BITS:
            raise ValueError(f"{qtype.name} has no int4pack form")
        return Int4PackLinear(data, qtype, shape, exact_from_t=0 if precise else INT4_EXACT_FROM_T)
    if strategy in ("dense_f16", "dense_bf16"):
        dtype = torch.float16 if strategy == "dense_f16" else torch.bfloat16
        return DenseHalfLinear(data, qtype, shape, HALF_FP32_FROM_T, dtype)
    if strategy == "triton":
        from localllm.kernels.quant.triton_linear import (
            TritonLinear,
        )  # only here: CPU never needs it

        if qtype in TRITON_WIDENED and widened_type(qtype) != qtype:  # as Q8_0 blocks, exactly
            data, qtype = widen_blocks(data, qtype), WIDENED[qtype]
        return TritonLinear(data, qtype, shape)
    if strategy == "half_gemm":
        return HalfGemmLinear(data, qtype, shape)
    if strategy == "dense_f32":
        return Float32Linear(dequantize(data, qtype).reshape(shape))
    return DequantTilesLinear(data, qtype, shape)


def prepare_parts(
    parts: list[torch.Tensor],
    qtype: QuantType,
    shape: tuple[int, int],
    precise: bool = False,
    native=None,
) -> PreparedLinear | None:
    """A weight given as parts of its rows (uint8 [rows_i, row bytes] each: a fused projection's
    tensors, in order) on the native CPU kernels, which read them where they lie (no stacked
    copy); None where those do not take it (no kernels, `precise`, a type or size they lack)."""
    qtype = QuantType(qtype)
    kernels = getattr(native, "blocks", None)
    if kernels is None or precise or qtype not in NATIVE_TYPES:
        return None
    if not kernels.supports(qtype, shape[1]) or any(p.device.type != "cpu" for p in parts):
        return None
    if len(parts) > MAX_PARTS:
        return None
    return NativeLinear(parts, qtype, shape, kernels)


def quant_matmul_reference(
    x: torch.Tensor, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int]
) -> torch.Tensor:
    """x @ dequantize(data).reshape(shape).T in float32: the oracle for every strategy."""
    return x.float() @ dequantize(data, qtype).reshape(shape).T
