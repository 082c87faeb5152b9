"""Host side of the grouped expert GEMMs (`triton_grouped`): pairs sorted and padded by expert
on the device, the K order the kernels' weight tiles come out in, the launch, and a plain-torch
reference. Prefill runs an expert's rows through its quantized weights without expanding them.

Sorting never syncs with the host: the launch has an upper bound of row blocks, and blocks past
the last expert's padded rows see expert -1 and return. A pair's row is computed from its own
activation row and its expert's tiles only, so which other pairs share a launch (or whether the
experts are resident or fetched one at a time) does not change its bits.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from localllm.kernels.moe.triton_grouped import _grouped_q4k, _grouped_q6k, _grouped_q8_0
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.repack import PackedBlocks
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

    block_n: int = 64
    warps: int = 4
    stages: int = 3


def block_rows(pairs: int, n_expert: int) -> int:
    """Rows per block for `pairs` spread over `n_expert` experts: big blocks where experts get
    many rows (fewer re-reads of each weight tile), small where most of a block would be
    padding."""
    per = pairs / max(n_expert, 1)
    return 16 if per <= 16 else 32 if per <= 48 else 64


def sort_pairs(ids: torch.Tensor, n_expert: int, bm: int) -> SortedPairs:
    """Flat expert ids [P] -> SortedPairs, on the ids' device with no host sync."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    counts = torch.zeros(n_expert, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pend = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    se = flat[order]
    rank = torch.arange(p, device=dev) - (counts.cumsum(0) - counts)[se]
    blocks = triton.cdiv(p + min(n_expert, p) * (bm - 1), bm)
    rows = torch.full((blocks * bm,), -1, dtype=torch.int32, device=dev)
    rows[(pend - padded)[se] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * bm
    experts = torch.searchsorted(pend, starts, right=True)
    experts = torch.where(experts < n_expert, experts, -1).to(torch.int32)
    return SortedPairs(rows, experts, bm, p)


def _q8_step(nb: int) -> int:
    return 2 if nb % 2 == 0 else 1


@lru_cache(maxsize=64)
def _k_order(qtype: QuantType, k: int) -> tuple[int, ...]:
    nb = k // block_geometry(qtype)[0]
    out = []
    if qtype == QuantType.Q4_K:  # per 64: nibble t of word w -> sub-block 2 jj + t % 2
        for s in range(nb):
            for jj in range(4):
                out += [
                    s * 256 + (2 * jj + t % 2) * 32 + 4 * w + t // 2
                    for t in range(8)
                    for w in range(8)
                ]
    elif qtype == QuantType.Q6_K:  # per 32: byte b of word w of quarter q of half hf
        for s in range(nb):
            for hf in range(2):
                for q in range(4):
                    base = s * 256 + hf * 128 + 32 * q
                    out += [base + 4 * w + b for b in range(4) for w in range(8)]
    elif qtype == QuantType.Q8_0:  # per BB blocks: byte b of word w
        bb = _q8_step(nb)
        for i in range(nb // bb):
            out += [
                (i * bb + w // 8) * 32 + 4 * (w % 8) + b for b in range(4) for w in range(8 * bb)
            ]
    else:
        raise ValueError(f"no grouped GEMM for {qtype.name}")
    return tuple(out)


def k_order(qtype: QuantType, k: int, device: torch.device) -> torch.Tensor:
    """Column j of the kernels' K order is column k_order[j] of the activations."""
    return torch.tensor(_k_order(QuantType(qtype), k), dtype=torch.int64, device=device)


def grouped_gemm(
    a: torch.Tensor,
    sp: SortedPairs,
    p: PackedBlocks,
    adiv: int,
    pairs: int,
    cfg: GroupedConfig = GroupedConfig(),
) -> torch.Tensor:
    """Pair i's row: activation row i // adiv of `a` [R, K] times its expert's W^T (stacked
    planes `p`) -> float32 [pairs, N]. `a` in the file's K order (permuted here, cast to bf16)."""
    ap = a.index_select(1, k_order(p.qtype, p.k, a.device)).float().contiguous()
    out = torch.empty(pairs, p.n, dtype=torch.float32, device=a.device)
    pl, nb = p.planes, p.k // block_geometry(p.qtype)[0]
    grid = (sp.experts.numel(), triton.cdiv(p.n, cfg.block_n))
    head = (ap, sp.rows, sp.experts)
    tail = (out, p.n, p.k, adiv)
    geo = {"NB": nb, "BM": sp.bm, "BN": cfg.block_n, "F32": not a.is_cuda}
    geo |= {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if p.qtype == QuantType.Q4_K:
        _grouped_q4k[grid](*head, pl["qs"], pl["hdr"], *tail, **geo)
    elif p.qtype == QuantType.Q6_K:
        _grouped_q6k[grid](*head, pl["ql"], pl["qh"], pl["sc"], pl["d"], *tail, **geo)
    elif p.qtype == QuantType.Q8_0:
        _grouped_q8_0[grid](*head, pl["qs"], pl["d"], *tail, BB=_q8_step(nb), **geo)
    else:
        raise ValueError(f"no grouped GEMM for {p.qtype.name}")
    return out


def grouped_gemm_reference(
    a: torch.Tensor, ids: torch.Tensor, raw: torch.Tensor, qtype: QuantType, adiv: int
) -> torch.Tensor:
    """Plain torch over the file's blocks `raw` uint8 [E, N, row_bytes] (K from `a`): each pair's
    bf16 row times its expert's W^T rounded to bf16, in float64."""
    flat = ids.reshape(-1).long().cpu()
    e, n, k = raw.shape[0], raw.shape[1], a.shape[1]
    w = dequantize(raw.cpu().reshape(e * n, -1), qtype).reshape(e, n, k)
    w = w.to(torch.bfloat16).double()
    x = a.cpu().to(torch.bfloat16).double()[torch.arange(flat.numel()) // adiv]
    return torch.einsum("pk,pnk->pn", x, w[flat])
