"""Experts on a CUDA device in the packed dp4a layout (`repack`): decode runs grouped GEMVs whose
programs read each pair's expert id on the device (no host sync, so CUDA graphs capture it);
prefill dequantizes each selected expert to bf16 for two GEMMs.

Every path computes a (token, expert) pair the same way whatever shares its launch: experts
resident as [E, ...] planes and experts packed one at a time from a streamed slot give the same
bits, so greedy output does not depend on where the experts live. Imported only where CUDA
exists (or under TRITON_INTERPRET=1 in tests). The oracle is `experts.expert_ffn_reference`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from localllm.kernels.fused.ops import silu_mul
from localllm.kernels.moe.experts import ExpertBlocks, ExpertFormat, _glu, group_by_expert
from localllm.kernels.quant.repack import (
    PACKED_TYPES,
    PackedBlocks,
    expert_planes,
    expert_slice,
    pack_expert_blocks,
)
from localllm.kernels.quant.triton_packed import (
    dequantize_packed_t,
    gemv_packed_grouped,
    grouped_counters,
    quantize_x8,
)
from localllm.kernels.quant.types import block_geometry

PACKED_MAX_T = 8  # token rows per call that take the grouped GEMVs (the decode graph ladder's top)


@dataclass(frozen=True)
class PackedExperts:
    """One layer's experts: the input projections (gate and up fused as [E, 2H] when they share a
    type, else gate then up) and down, with split-K counters for PACKED_MAX_T tokens."""

    gate_up: tuple[PackedBlocks, ...]
    down: PackedBlocks
    counters: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (*self.gate_up, self.down))

    def expert(self, e: int) -> "PackedExperts":
        """Expert e alone (views; its id in the result is 0)."""
        gu = tuple(expert_slice(p, e) for p in self.gate_up)
        return PackedExperts(gu, expert_slice(self.down, e), self.counters)


def packable(fmt: ExpertFormat) -> bool:
    """Whether the layer's expert types have packed kernels (K a whole number of blocks)."""
    shapes = ((fmt.gate, fmt.dim), (fmt.up, fmt.dim), (fmt.down, fmt.hidden))
    return all(t in PACKED_TYPES and k % block_geometry(t)[0] == 0 for t, k in shapes)


def pack_experts(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: ExpertFormat, n_used: int
) -> PackedExperts:
    """Raw stacked blocks gate/up [E, H, rb], down [E, D, rb] -> PackedExperts."""
    e, h, d = gate.shape[0], fmt.hidden, fmt.dim
    if fmt.gate == fmt.up:
        both = torch.cat([gate.reshape(e, h, -1), up.reshape(e, h, -1)], dim=1)
        gu = (pack_expert_blocks(both, fmt.gate, 2 * h, d),)
    else:
        gu = (pack_expert_blocks(gate, fmt.gate, h, d), pack_expert_blocks(up, fmt.up, h, d))
    dn = pack_expert_blocks(down, fmt.down, d, h)
    pairs = PACKED_MAX_T * n_used
    return PackedExperts(gu, dn, tuple(grouped_counters(p, pairs) for p in (*gu, dn)))


def _act(h: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    if fmt.act == "silu":
        return silu_mul(h, fmt.hidden)
    g, u = h.split(fmt.hidden, dim=-1)
    return _glu(g, u, fmt.act).contiguous()


def ffn_pairs(
    x: torch.Tensor, ids: torch.Tensor, xdiv: int, pe: PackedExperts, fmt: ExpertFormat
) -> torch.Tensor:
    """Pair p's FFN: row p // xdiv of x [R, dim] through expert ids[p] -> float32 [pairs, dim]."""
    xq = quantize_x8(x.float().contiguous())
    counters = pe.counters[: len(pe.gate_up)]  # the last one is down's
    parts = [
        gemv_packed_grouped(xq, p, ids, xdiv, c) for p, c in zip(pe.gate_up, counters, strict=True)
    ]
    h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    aq = quantize_x8(_act(h, fmt))
    return gemv_packed_grouped(aq, pe.down, ids, 1, pe.counters[-1])


def ffn_rows_bf16(x: torch.Tensor, pe: PackedExperts, fmt: ExpertFormat) -> torch.Tensor:
    """A single expert's FFN on many rows x [n, dim] as bf16 GEMMs -> float32 [n, dim]."""
    xb = x.to(torch.bfloat16)
    parts = [(xb @ dequantize_packed_t(expert_planes(p, 0))).float() for p in pe.gate_up]
    h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    a = _act(h, fmt).to(torch.bfloat16)
    return (a @ dequantize_packed_t(expert_planes(pe.down, 0))).float()


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's k pairs: y [T * k, dim], weights [T, k] -> [T, dim]."""
    t, k = weights.shape
    return torch.bmm(weights.float().view(t, 1, k), y.view(t, k, -1)).view(t, -1)


def expert_ffn_packed(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, pe: PackedExperts, fmt: ExpertFormat
) -> torch.Tensor:
    """Resident packed experts: x [T, dim], routing [T, k] -> float32 [T, dim]."""
    t, k = ids.shape
    if t <= PACKED_MAX_T:
        return combine(ffn_pairs(x, ids.reshape(-1), k, pe, fmt), weights)
    return _per_expert(x, weights, ids, lambda e: pe.expert(e), fmt)


def expert_ffn_fetched(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fetch: Callable[[int], ExpertBlocks],
    fmt: ExpertFormat,
) -> torch.Tensor:
    """Experts fetched one at a time (a streamed slot, a host copy): each is packed as it comes
    and computed exactly as its resident packed form would be."""

    def one(e: int) -> PackedExperts:
        b = fetch(e)
        return pack_experts(b.gate[None], b.up[None], b.down[None], fmt, 1)

    return _per_expert(x, weights, ids, one, fmt)


def _per_expert(x, weights, ids, expert: Callable[[int], PackedExperts], fmt) -> torch.Tensor:
    t, k = ids.shape
    order, experts, counts = group_by_expert(ids)
    tokens = order // k
    y = torch.empty(t * k, fmt.dim, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in zip(experts, counts, strict=True):
        pairs = order[start : start + n]
        rows = x[tokens[start : start + n]]
        pe = expert(e)
        if t <= PACKED_MAX_T:
            zero = torch.zeros(n, dtype=torch.int64, device=x.device)
            y[pairs] = ffn_pairs(rows, zero, 1, pe, fmt)
        else:
            y[pairs] = ffn_rows_bf16(rows, pe, fmt)
        start += n
    return combine(y, weights)
