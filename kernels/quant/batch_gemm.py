"""Host side of the batched-decode GEMMs over packed blocks (`triton_batch_gemm`): launch
geometry and `batch_gemm`, with a plain-torch reference.

`TritonLinear` takes this path for 9 to `MAX_ROWS` activation rows when
`triton_linear.BATCH_GEMM` is on; past that the bf16 copy of the weight and cuBLAS stay. Imported
only where CUDA exists (or under TRITON_INTERPRET=1 in tests).
"""

from dataclasses import dataclass

import torch
import triton

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.repack import PackedBlocks, unpack_blocks
from localllm.kernels.quant.triton_batch_gemm import _bgemm_q4k, _bgemm_q6k, _bgemm_q8_0
from localllm.kernels.quant.types import QuantType, block_geometry

MAX_ROWS = 64  # one row block of 64 at most: past it a bf16 copy's GEMM has the better tiles


@dataclass(frozen=True, slots=True)
class BatchGemmConfig:
    """Weight rows per program, warps, pipeline stages, and how many programs a launch aims at
    (K is split until the tiles times the splits reach it, keeping `min_blocks` super-blocks,
    or 8 Q8_0 blocks, per split). Defaults not yet tuned on a GPU
    (tests/perf/bench_dense_rows.py sweeps them)."""

    block_n: int = 64
    warps: int = 4
    stages: int = 3
    target_programs: int = 264  # two per SM of an H100 / H200 (132 SMs)
    min_blocks: int = 2


def row_block(m: int) -> int:
    """Activation rows per program: the power of two at least m, 16 to 64 (tensor-core tiles
    need 16)."""
    return min(max(16, triton.next_power_of_2(m)), MAX_ROWS)


def splits(p: PackedBlocks, m: int, cfg: BatchGemmConfig) -> tuple[int, int]:
    """(splits of K, super-blocks or blocks per split) for m rows of `p`."""
    nb = p.k // block_geometry(p.qtype)[0]
    tiles = triton.cdiv(p.n, cfg.block_n) * triton.cdiv(m, row_block(m))
    least = cfg.min_blocks * (8 if p.qtype == QuantType.Q8_0 else 1)
    want = max(1, min(triton.cdiv(cfg.target_programs, tiles), nb // least))
    per = triton.cdiv(nb, want)
    return triton.cdiv(nb, per), per


def batch_gemm(
    x: torch.Tensor, p: PackedBlocks, cfg: BatchGemmConfig = BatchGemmConfig()
) -> torch.Tensor:
    """x [M, K] (any float dtype; rounded to bf16) @ W.T for a packed W [N, K] -> float32 [M, N],
    for 1 <= M <= MAX_ROWS. W's values are rounded to bf16 as `dequantize_packed_t` rounds them,
    so the result is that of the bf16 copy's GEMM up to float32 summation order."""
    m = x.shape[0]
    if not 0 < m <= MAX_ROWS or x.shape[1] != p.k:
        raise ValueError(f"batch_gemm takes [1..{MAX_ROWS}, {p.k}] rows, not {list(x.shape)}")
    xb = x.to(torch.bfloat16).contiguous()
    n_split, per = splits(p, m, cfg)
    out = torch.empty(n_split, m, p.n, dtype=torch.float32, device=x.device)
    bm = row_block(m)
    grid = (triton.cdiv(p.n, cfg.block_n), n_split, triton.cdiv(m, bm))
    nb = p.k // block_geometry(p.qtype)[0]
    tail = (out, m, p.n, p.k, nb, per)
    geo = {"BM": bm, "BN": cfg.block_n, "HALF": x.is_cuda}
    geo |= {"num_warps": cfg.warps, "num_stages": cfg.stages}
    pl = p.planes
    if p.qtype == QuantType.Q4_K:
        _bgemm_q4k[grid](xb, pl["qs"], pl["hdr"], *tail, **geo)
    elif p.qtype == QuantType.Q6_K:
        _bgemm_q6k[grid](xb, pl["ql"], pl["qh"], pl["sc"], pl["d"], *tail, **geo)
    elif p.qtype == QuantType.Q8_0:
        _bgemm_q8_0[grid](xb, pl["qs"], pl["d"], *tail, **geo)
    else:
        raise ValueError(f"no batch GEMM for {p.qtype.name}")
    # the splits' partial sums in a fixed order: the same bits on every run
    return out[0] if n_split == 1 else out.sum(0)


def batch_gemm_reference(x: torch.Tensor, p: PackedBlocks) -> torch.Tensor:
    """Plain torch, float64: x rounded to bf16 times W (gguf's dequantization) rounded to bf16."""
    w = dequantize(unpack_blocks(p).cpu(), p.qtype).reshape(p.n, p.k)
    xb = x.cpu().to(torch.bfloat16).double()
    return xb @ w.to(torch.bfloat16).double().T
