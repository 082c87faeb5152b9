"""Host side of the grouped expert GEMMs (`triton_grouped`): pairs sorted and padded by expert
on the device, the launch, and a plain-torch reference. Prefill runs an expert's rows through
its quantized weights, int8 activations against the file's codes, without expanding anything.

Sorting never syncs with the host: the launch has an upper bound of row blocks, and blocks past
the last expert's padded rows see expert -1 and return. A pair's row is computed from its own
activation row and its expert's tiles only, so which other pairs share a launch (or whether the
experts are resident or fetched one at a time) does not change its bits.
"""

from dataclasses import dataclass

import torch
import triton

from localllm.kernels.moe.triton_grouped import _grouped_q4k, _grouped_q6k, _grouped_q8_0
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.repack import PackedBlocks
from localllm.kernels.quant.triton_packed import QuantizedX, quantize_x8_reference
from localllm.kernels.quant.types import QuantType, block_geometry


@dataclass(frozen=True, slots=True)
class SortedPairs:
    """`pairs` padded to `bm` rows per expert: `rows` int32 [blocks * bm] (pair or -1) and
    `experts` int32 [blocks] (each row block's expert, -1 past the end)."""

    rows: torch.Tensor
    experts: torch.Tensor
    bm: int
    pairs: int


@dataclass(frozen=True, slots=True)
class GroupedConfig:
    """Weight rows per program, warps, software pipeline stages."""

    block_n: int = 128
    warps: int = 4
    stages: int = 3


def block_rows(pairs: int, n_expert: int) -> int:
    """Rows per block for `pairs` spread over `n_expert` experts: big blocks where experts get
    many rows (fewer re-reads of each weight tile), small where most of a block would be
    padding."""
    per = pairs / max(n_expert, 1)  # H200, Q4_K 1536x2048 x 128 experts: 16 best at 8 rows
    return 16 if per <= 12 else 64  # per expert, 64 at 32 and 128 (bench_moe_prefill)


def sort_pairs(ids: torch.Tensor, n_expert: int, bm: int) -> SortedPairs:
    """Flat expert ids [P] -> SortedPairs, on the ids' device with no host sync."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    counts = torch.zeros(n_expert, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pend = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    shift = (pend - padded) - (counts.cumsum(0) - counts)  # padded start - packed start
    blocks = triton.cdiv(p + min(n_expert, p) * (bm - 1), bm)
    rows = torch.full((blocks * bm,), -1, dtype=torch.int32, device=dev)
    rows[torch.arange(p, device=dev) + shift[flat[order]]] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * bm
    experts = torch.searchsorted(pend, starts, right=True)
    experts = torch.where(experts < n_expert, experts, -1).to(torch.int32)
    return SortedPairs(rows, experts, bm, p)


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
    elif p.qtype == QuantType.Q8_0:
        _grouped_q8_0[grid](x8, xq.scale, *rows, pl["qs"], pl["d"], *tail, **geo)
    else:
        raise ValueError(f"no grouped GEMM for {p.qtype.name}")
    return out


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
