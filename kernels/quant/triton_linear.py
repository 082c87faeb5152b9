"""Host side of the triton keep-quant kernels: launch geometry, `gemv`, `dequantize_bf16` and
`TritonLinear` (the CUDA strategy of `prepare_linear`). Imported only where CUDA exists (or under
TRITON_INTERPRET=1 in tests): CPU installs never import triton.
"""

from dataclasses import dataclass

import torch
import triton

from localllm.kernels.quant.batch_gemm import MAX_ROWS as BATCH_MAX_ROWS
from localllm.kernels.quant.batch_gemm import batch_gemm
from localllm.kernels.quant.dequant_legacy import FP4_VALUES, IQ4_NL_VALUES, kvalues_lut
from localllm.kernels.quant.repack import PACKED_TYPES, PackedBlocks, pack_blocks
from localllm.kernels.quant.triton_gemv import (
    _deq_nib32,
    _deq_q4_k,
    _deq_q6_k,
    _deq_q8_0,
    _gemv_nib32,
    _gemv_q4_k,
    _gemv_q6_k,
    _gemv_q8_0,
)
from localllm.kernels.quant.triton_packed import MAX_ROWS as PACKED_MAX_ROWS
from localllm.kernels.quant.triton_packed import (
    QuantizedX,
    dequantize_packed_t,
    gemv_packed,
    packed_config,
    quantize_x8,
    split_counters,
)
from localllm.kernels.quant.types import QuantType

GEMV_MAX_M = 8  # more activation rows than this: dequantize to bf16 and use a GEMM
# packed weights between GEMV_MAX_M and batch_gemm.MAX_ROWS (64) rows, batched decode: one GEMM
# that expands the weight's tiles in registers (`batch_gemm`) instead of writing a bf16 copy of
# the whole weight and reading it back for cuBLAS (the copy is most of a 16-64 sequence decode
# step's traffic). On by default: `serve` on an H100 (8B Q4_K_M, 2026-12-07 12:18-12:24 UTC,
# tests/perf/results/server.md) streamed 1,290 / 2,037 tok/s at 16 / 64 streams with it against
# 839 / 1,833 without, one stream unchanged; off: the bf16 copy and cuBLAS (an A/B switch)
BATCH_GEMM = True
# the fewest rows BATCH_GEMM takes: 5-8 rows run the GEMVs in two launches of 4, each reading the
# weight; the sweep (`bench_dense_rows.py`) times the batch GEMM at 8 rows too, to see if 5 pays
BATCH_MIN_ROWS = GEMV_MAX_M + 1
# the int8 tensor-core GEMM over the packed blocks (`kernels.moe.grouped.dense_gemm`) for the
# same rows. Off: on an H100 (8B shape, tests/perf/results/server.md, 2026-12-07 08:19) the
# engine's 16 / 64 concurrent decodes ran 818 / 1,521 tok/s with it against 1,004 / 3,042
# without (one row block over the whole weight gives N / 64 programs, each looping over all of
# K: too few for the GPU; register spills at 64 rows). An A/B switch; BATCH_GEMM wins over it
DENSE_INT8 = False
DENSE_MAX_ROWS = 64
# keep a bf16 copy of each packed weight beside its blocks (made at load) for the GEMMs of many
# rows (prompt chunks, steps that mix a chunk with decodes): no dequantization per call, at two
# bytes a weight more device memory (~15 GB for an 8B model). An A/B switch, off until a GPU has
# timed it (tests/perf/gpu_serve2.sh `ours-shadow`); set it before load
HALF_SHADOW = False

# 4-bit codes in 32-value groups: the kernel's KIND and code table
_NIB32 = {
    QuantType.Q4_0: (0, None),
    QuantType.IQ4_NL: (1, IQ4_NL_VALUES),
    QuantType.MXFP4: (2, FP4_VALUES),
    QuantType.IQ4_XS: (3, IQ4_NL_VALUES),
}
SUPPORTED: frozenset[QuantType] = frozenset(
    {QuantType.Q8_0, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, *_NIB32}
)


def _nib32_args(data: torch.Tensor, qtype: QuantType) -> tuple[int, torch.Tensor]:
    kind, values = _NIB32[qtype]
    # Q4_0 reads no table: any float tensor fills the argument
    return kind, kvalues_lut(values or FP4_VALUES, data.device)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch geometry of one GEMV: rows per program, blocks (Q8_0/Q4_0) or super-blocks (Q4_K,
    Q5_K) per loop step, warps."""

    block_n: int
    step: int
    num_warps: int = 4


def gemv_config(qtype: QuantType, n: int) -> GemvConfig:
    # Enough row tiles to fill 132 SMs several times over at M = 1; wider tiles for big N.
    # Measured on the H200 (tests/perf/bench_gpu.py sweep, Llama-3-8B gate_up and down shapes)
    if qtype == QuantType.Q6_K:
        return GemvConfig(8, 1, 2)
    if qtype in (QuantType.Q4_K, QuantType.Q5_K):
        return GemvConfig(4, 4, 2)
    return GemvConfig(8 if n >= 16384 else 4, 16, 2)


def gemv(
    x: torch.Tensor,
    data: torch.Tensor,
    qtype: QuantType,
    n: int,
    k: int,
    cfg: GemvConfig | None = None,
) -> torch.Tensor:
    """float32 x [M, K] @ W.T for raw blocks `data` uint8 [N, row_bytes] -> float32 [M, N]."""
    qtype = QuantType(qtype)
    x = x.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    c = cfg or gemv_config(qtype, n)
    grid = (m * triton.cdiv(n, c.block_n),)
    geo = {"BLOCK_N": c.block_n, "num_warps": c.num_warps}
    if qtype == QuantType.Q8_0:
        _gemv_q8_0[grid](x, data, y, m, n, k, k // 32, data.shape[1], BB=c.step, **geo)
    elif qtype in _NIB32:
        kind, lut = _nib32_args(data, qtype)
        nb, rb = k // 32, data.shape[1]
        _gemv_nib32[grid](x, data, lut, y, m, n, k, nb, rb, BB=c.step, KIND=kind, **geo)
    elif qtype in (QuantType.Q4_K, QuantType.Q5_K):
        w32, five = data.view(torch.int32), qtype == QuantType.Q5_K
        _gemv_q4_k[grid](x, w32, y, m, n, k, k // 256, w32.shape[1], S=c.step, FIVE=five, **geo)
    elif qtype == QuantType.Q6_K:
        _gemv_q6_k[grid](x, data, y, m, n, k, k // 256, data.shape[1], **geo)
    else:
        raise ValueError(f"no triton GEMV for {qtype.name}")
    return y


def dequantize_bf16(data: torch.Tensor, qtype: QuantType, n: int, k: int) -> torch.Tensor:
    """W [N, K] in bf16 from raw blocks (each value rounded once from gguf's float32 value)."""
    qtype = QuantType(qtype)
    out = torch.empty(n, k, dtype=torch.bfloat16, device=data.device)
    if qtype == QuantType.Q8_0:
        grid = (triton.cdiv(n, 16), triton.cdiv(k // 32, 8))
        _deq_q8_0[grid](data, out, n, k, k // 32, data.shape[1], BLOCK_N=16, BB=8, num_warps=4)
    elif qtype in _NIB32:
        kind, lut = _nib32_args(data, qtype)
        grid = (triton.cdiv(n, 16), triton.cdiv(k // 32, 8))
        nb, rb = k // 32, data.shape[1]
        _deq_nib32[grid](data, lut, out, n, k, nb, rb, BLOCK_N=16, BB=8, KIND=kind, num_warps=4)
    elif qtype in (QuantType.Q4_K, QuantType.Q5_K):
        w32, five = data.view(torch.int32), qtype == QuantType.Q5_K
        grid = (triton.cdiv(n, 16), k // 256)
        _deq_q4_k[grid](w32, out, n, k, w32.shape[1], BLOCK_N=16, S=1, FIVE=five, num_warps=4)
    elif qtype == QuantType.Q6_K:
        grid = (triton.cdiv(n, 16), k // 256)
        _deq_q6_k[grid](data, out, n, k, data.shape[1], BLOCK_N=16, num_warps=4)
    else:
        raise ValueError(f"no triton dequant for {qtype.name}")
    return out


class TritonLinear:
    """A raw-block weight [N, K] on CUDA: fused GEMV for M <= GEMV_MAX_M rows, else the weight
    dequantized to bf16 (one pass, scratch freed after the call) and a bf16 GEMM (with
    BATCH_GEMM, packed types up to 64 rows take `batch_gemm`, which expands the weight in
    registers; with DENSE_INT8 the int8 GEMM over their blocks).

    Q4_K, Q6_K and Q8_0 are re-laid out column-major once (`repack`, same bytes) for the dp4a
    kernels; `repacked` tells the owner that the raw copy it passed is no longer needed.
    """

    kind = "triton"

    def __init__(self, data: torch.Tensor, qtype: QuantType, shape: tuple[int, int]):
        qtype = QuantType(qtype)
        native = qtype == QuantType.Q5_0  # packed as stored (`linear`: with widen.NATIVE_Q5_0)
        if qtype not in SUPPORTED and not native:
            raise ValueError(f"no triton kernels for {qtype.name}")
        self.qtype, self.shape = qtype, shape
        self.data: torch.Tensor | None = None
        self.packed: PackedBlocks | None = None
        self.shadow: torch.Tensor | None = None
        if qtype in PACKED_TYPES or native:
            self.packed = pack_blocks(data, qtype, *shape)
            self.cfg = packed_config(qtype, *shape)
            self.counters = split_counters(self.packed, self.cfg)
            if DENSE_INT8:  # its row lists at load, never inside a capture (set it before load)
                # (a package edge to the grouped GEMMs, which import this package's kernels only)
                from localllm.kernels.moe.grouped import prepare_dense

                prepare_dense(self.packed.device, DENSE_MAX_ROWS)
            if HALF_SHADOW:
                self.shadow = dequantize_packed_t(self.packed)
        else:
            self.data = data.reshape(shape[0], -1).contiguous()
            self.cfg = gemv_config(qtype, shape[0])

    @property
    def repacked(self) -> bool:
        return self.packed is not None

    def takes_quantized(self, rows: int) -> bool:
        """Whether `matmul` of `rows` rows reads an `xq` (its rows quantized to int8 per 32)."""
        if self._batch(rows):
            return False
        dense = DENSE_INT8 and GEMV_MAX_M < rows <= DENSE_MAX_ROWS
        return self.packed is not None and (0 < rows <= PACKED_MAX_ROWS or dense)

    def _batch(self, rows: int) -> bool:
        """Whether `rows` rows take `batch_gemm` (BATCH_MIN_ROWS never below the GEMVs' 4)."""
        low = max(BATCH_MIN_ROWS, PACKED_MAX_ROWS + 1)
        if self.packed is None or self.packed.qtype not in PACKED_TYPES:  # (Q5_0: no batch GEMM)
            return False
        return BATCH_GEMM and low <= rows <= BATCH_MAX_ROWS

    def takes_tail(self, rows: int) -> bool:
        """Whether `matmul` of `rows` rows can add a LoRA epilogue (one packed GEMV launch)."""
        return self.packed is not None and 0 < rows <= PACKED_MAX_ROWS

    @property
    def nbytes(self) -> int:
        """The weight's bytes as loaded (with HALF_SHADOW, the bf16 copy's besides)."""
        if self.packed is None:
            return self.data.numel()
        extra = 0 if self.shadow is None else self.shadow.numel() * self.shadow.element_size()
        return self.packed.nbytes + extra

    def matmul(self, x: torch.Tensor, xq: QuantizedX | None = None, lora=None) -> torch.Tensor:
        """x [..., K] -> [..., N]; `xq`: x's rows already quantized (the dp4a GEMVs use it);
        `lora`: a `LoraTail` the packed GEMV adds in its epilogue (`takes_tail` must hold)."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        small = x2.shape[0] <= GEMV_MAX_M
        if lora is not None and not self.takes_tail(x2.shape[0]):
            raise ValueError(f"no LoRA epilogue for {self.qtype.name} at {x2.shape[0]} rows")
        if self._batch(x2.shape[0]):
            y = batch_gemm(x2, self.packed)
        elif self.packed is not None and small:
            y = gemv_packed(x2, self.packed, self.cfg, self.counters, xq, lora)
        elif self.packed is not None and DENSE_INT8 and x2.shape[0] <= DENSE_MAX_ROWS:
            from localllm.kernels.moe.grouped import dense_gemm

            y = dense_gemm(xq if xq is not None else quantize_x8(x2), self.packed, x2.shape[0])
        elif self.packed is not None:
            wt = self.shadow if self.shadow is not None else dequantize_packed_t(self.packed)
            y = torch.mm(x2.to(torch.bfloat16), wt).float()
        elif small:
            y = gemv(x2, self.data, self.qtype, n, k, self.cfg)
        else:
            w = dequantize_bf16(self.data, self.qtype, n, k)
            y = torch.nn.functional.linear(x2.to(torch.bfloat16), w).float()
        return y.reshape(*x.shape[:-1], n)
