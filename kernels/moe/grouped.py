"""Host side of the grouped expert GEMMs (`triton_grouped`): the launch over pairs grouped by
expert (`pairs.sort_pairs`) and a plain-torch reference. Prefill runs an expert's rows through
its quantized weights, int8 activations against the file's codes, without expanding anything.

A pair's row is computed from its own activation row and its expert's tiles only, so which other
pairs share a launch (or whether the experts are resident or fetched one at a time) does not
change its bits (measured on the H200 with 16, 32 and 64 rows per block).
"""

from dataclasses import dataclass

import torch
import triton

from localllm.kernels.moe.pairs import SortedPairs
from localllm.kernels.moe.triton_grouped import _grouped_q4k, _grouped_q6k, _grouped_q8_0
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.q8x_reference import quantize_x8_reference
from localllm.kernels.quant.repack import PackedBlocks
from localllm.kernels.quant.triton_packed import QuantizedX
from localllm.kernels.quant.types import QuantType, block_geometry


@dataclass(frozen=True, slots=True)
class GroupedConfig:
    """Weight rows per program, warps, software pipeline stages."""

    block_n: int = 128
    warps: int = 4
    stages: int = 3


def grouped_gemm(
    xq: QuantizedX,
    sp: SortedPairs,
    p: PackedBlocks,
    adiv: int,
    cfg: GroupedConfig = GroupedConfig(),
) -> torch.Tensor:
    """Pair i's row: quantized activation row i // adiv of `xq` ([R, K] as `quantize_x8` makes
    it) times its expert's W^T (stacked planes `p`) -> float32 [pairs, N]."""
    x8 = xq.words.view(torch.int8)
    out = torch.empty(sp.pairs, p.n, dtype=torch.float32, device=x8.device)
    pl, nb = p.planes, p.k // block_geometry(p.qtype)[0]
    grid = (sp.experts.numel(), triton.cdiv(p.n, cfg.block_n))
    rows = (sp.rows, sp.experts)
    tail = (out, p.n, p.k, adiv)
    geo = {"NB": nb, "BM": sp.bm, "BN": cfg.block_n, "num_warps": cfg.warps}
    geo["num_stages"] = cfg.stages
    if p.qtype == QuantType.Q4_K:
        _grouped_q4k[grid](x8, xq.scale, xq.xsum, *rows, pl["qs"], pl["hdr"], *tail, **geo)
    elif p.qtype == QuantType.Q6_K:
        planes = (pl["ql"], pl["qh"], pl["sc"], pl["d"])
        _grouped_q6k[grid](x8, xq.scale, *rows, *planes, *tail, **geo)
    elif p.qtype in (QuantType.Q8_0, QuantType.Q5_0):  # (Q5_0: experts', `widen.NATIVE_Q5_0`)
        q5 = p.qtype == QuantType.Q5_0
        planes = (pl["qs"], pl["d"], pl["qh" if q5 else "qs"])
        _grouped_q8_0[grid](x8, xq.scale, *rows, *planes, *tail, **geo, Q5=q5)
    else:
        raise ValueError(f"no grouped GEMM for {p.qtype.name}")
    return out


# a dense packed weight as one "expert" holding every row (`dense_gemm`, up to
# `triton_linear.DENSE_MAX_ROWS` rows, behind its DENSE_INT8 switch): tried for batched decode in
# place of a bf16 copy of the weight per call, and measured slower (tests/perf/results/server.md)
DENSE_BLOCK_N = 64  # weight rows per program: one row block, so twice the programs of 128
_DENSE_PAIRS: dict[torch.device, list[SortedPairs]] = {}


def prepare_dense(device: torch.device, max_rows: int) -> None:
    """Make `dense_gemm`'s row lists for `device` up to `max_rows` rows (call outside any CUDA
    graph capture: at load): for M rows, blocks of the power of two at least M (16 to 64 rows)
    holding 0..M-1, padding -1, all on expert 0."""
    if len(_DENSE_PAIRS.get(device, ())) >= max_rows:
        return
    made = []
    for m in range(1, max_rows + 1):
        bm = min(max(16, triton.next_power_of_2(m)), 64)
        blocks = -(-m // bm)
        rows = torch.full((blocks * bm,), -1, dtype=torch.int32)
        rows[:m] = torch.arange(m, dtype=torch.int32)
        experts = torch.zeros(blocks, dtype=torch.int32)
        made.append(SortedPairs(rows.to(device), experts.to(device), bm, m))
    _DENSE_PAIRS[device] = made


def dense_gemm(xq: QuantizedX, p: PackedBlocks, m: int) -> torch.Tensor:
    """x [m, K] (quantized, `quantize_x8`) @ W.T for one packed weight W [N, K] -> float32 [m, N]
    through the grouped int8 GEMM, every row on expert 0 (the weight read once per call);
    `prepare_dense` must have run for the device with at least m rows."""
    sp = _DENSE_PAIRS[p.device][m - 1]
    return grouped_gemm(xq, sp, p, 1, GroupedConfig(block_n=DENSE_BLOCK_N))


def grouped_gemm_reference(
    a: torch.Tensor, ids: torch.Tensor, raw: torch.Tensor, qtype: QuantType, adiv: int
) -> torch.Tensor:
    """Plain torch over the file's blocks `raw` uint8 [E, N, row_bytes] (K from `a`): each pair's
    activation row rounded to int8 per 32 times its expert's gguf-dequantized W^T, in float64."""
    flat = ids.reshape(-1).long().cpu()
    e, n, k = raw.shape[0], raw.shape[1], a.shape[1]
    w = dequantize(raw.cpu().reshape(e * n, -1), qtype).reshape(e, n, k).double()
    x = quantize_x8_reference(a.cpu())[torch.arange(flat.numel()) // adiv]
    return torch.einsum("pk,pnk->pn", x, w[flat])
