"""Experts on a CUDA device in the packed dp4a layout (`repack`): decode runs grouped GEMVs whose
programs read each pair's expert id on the device (no host sync, so CUDA graphs capture it);
prefill sorts the pairs by expert on the device and runs grouped int8 tensor-core GEMMs over the
same packed blocks (`grouped`), again without a host sync.

Every path computes a (token, expert) pair the same way whatever shares its launch: experts
resident as [E, ...] planes and experts packed one at a time from a streamed slot give the same
bits, so greedy output does not depend on where the experts live. Imported only where CUDA
exists (or under TRITON_INTERPRET=1 in tests). The oracle is `experts.expert_ffn_reference`.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from localllm.kernels.fused.ops import WeightedRows, silu_mul, silu_mul_q
from localllm.kernels.moe.experts import ExpertBlocks, ExpertFormat, _glu, group_by_expert
from localllm.kernels.moe.grouped import grouped_gemm
from localllm.kernels.moe.pairs import SortedPairs, block_rows, sort_pairs
from localllm.kernels.moe.triton_combine import combine_cuda
from localllm.kernels.moe.triton_pairs import sort_pairs_cuda
from localllm.kernels.quant.repack import PackedBlocks, pack_expert_blocks, packs
from localllm.kernels.quant.triton_packed import (
    QuantizedX,
    gemv_packed_grouped,
    grouped_counters,
    quantize_x8,
)
from localllm.kernels.quant.widen import widened_type

PACK_CHUNK = 16  # experts a layer's load packs on the device at a time (`pack_layer`)
PACKED_MAX_T = 8  # token rows per call that take the grouped GEMVs (the decode graph ladder's top)
# The weighted sum as a PDL Triton kernel: written and tested under the interpreter and compiled
# for sm_90, not yet run on a GPU, so off until measured (h200_session.sh pdlab mode `tcomb`)
TRITON_COMBINE = False
# Decode rows summed by the next norm's kernel when the caller defers (benchmarks switch it off)
SUM_IN_NORM = True


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

    @property
    def n_expert(self) -> int:
        return next(iter(self.down.planes.values())).shape[0]


def packable(fmt: ExpertFormat, widen: bool = False) -> bool:
    """Whether the layer's expert types have packed kernels (K a whole number of blocks);
    `widen`: types packed as the Q8_0 blocks they widen to count too (`pack_expert_blocks`:
    resident and per-call packing; slot pools fill planes byte for byte from raw experts and
    take the packed types alone)."""
    shapes = ((fmt.gate, fmt.dim), (fmt.up, fmt.dim), (fmt.down, fmt.hidden))
    return all(packs(widened_type(t) if widen else t, k) for t, k in shapes)


def pack_experts(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: ExpertFormat, n_used: int
) -> PackedExperts:
    """Raw stacked blocks gate/up [E, H, rb], down [E, D, rb] -> PackedExperts."""
    gu, dn = pack_expert_planes(gate, up, down, fmt)
    pairs = PACKED_MAX_T * n_used
    return PackedExperts(gu, dn, tuple(grouped_counters(p, pairs) for p in (*gu, dn)))


def pack_expert_planes(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: ExpertFormat
) -> tuple[tuple[PackedBlocks, ...], PackedBlocks]:
    """`pack_experts`' planes alone: (gate_up, down), no split-K counters."""
    e, h, d = gate.shape[0], fmt.hidden, fmt.dim
    if fmt.gate == fmt.up:
        both = torch.cat([gate.reshape(e, h, -1), up.reshape(e, h, -1)], dim=1)
        gu = (pack_expert_blocks(both, fmt.gate, 2 * h, d),)
    else:
        gu = (pack_expert_blocks(gate, fmt.gate, h, d), pack_expert_blocks(up, fmt.up, h, d))
    return gu, pack_expert_blocks(down, fmt.down, d, h)


def pack_planes_in_chunks(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: ExpertFormat, device, chunk: int
) -> Iterator[tuple[int, tuple[PackedBlocks, ...]]]:
    """`pack_expert_planes` of raw blocks (on any device) packed on `device` `chunk` experts at a
    time: (first expert, (*gate_up, down)) per chunk. An expert's planes are its own slice, so
    the chunks stacked are the layer's planes; `device` holds one chunk's bytes at a time."""
    for i in range(0, gate.shape[0], chunk):
        gu, dn = pack_expert_planes(*(t[i : i + chunk].to(device) for t in (gate, up, down)), fmt)
        yield i, (*gu, dn)


def pack_layer(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    fmt: ExpertFormat,
    n_used: int,
    device,
    empty: Callable[[dict], dict] | None = None,
    writable: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    chunk: int = PACK_CHUNK,
) -> PackedExperts:
    """`pack_experts` of a layer's raw blocks (host tensors: the file's mapping) packed on
    `device` `chunk` experts at a time into planes from `empty` ({name: (shape, dtype)} ->
    {name: tensor}; default: on `device`), written through `writable` (a mapped plane's host
    view): the device holds one chunk's raw and packed bytes besides the planes, never the
    layer's twice."""
    if empty is None:
        empty = lambda specs: {n: torch.empty(s, dtype=d, device=device)
                               for n, (s, d) in specs.items()}  # fmt: skip
    out: list[PackedBlocks] = []
    e = gate.shape[0]
    for i, parts in pack_planes_in_chunks(gate, up, down, fmt, device, chunk):
        if not out:  # the whole layer's planes, shaped from the first chunk's
            out = [PackedBlocks(p.qtype, p.n, p.k, empty(
                {f: ((e, *t.shape[1:]), t.dtype) for f, t in p.planes.items()}))
                for p in parts]  # fmt: skip
        for dst, src in zip(out, parts, strict=True):
            for f, t in src.planes.items():
                writable(dst.planes[f])[i : i + t.shape[0]].copy_(t)
    counters = tuple(grouped_counters(p, PACKED_MAX_T * n_used) for p in out)
    return PackedExperts(tuple(out[:-1]), out[-1], counters)


def _act(h: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    if fmt.act == "silu":
        return silu_mul(h, fmt.hidden)
    g, u = h.split(fmt.hidden, dim=-1)
    return _glu(g, u, fmt.act).contiguous()


def ffn_pairs(
    x: torch.Tensor,
    ids: torch.Tensor,
    xdiv: int,
    pe: PackedExperts,
    fmt: ExpertFormat,
    xq: QuantizedX | None = None,
) -> torch.Tensor:
    """Pair p's FFN: row p // xdiv of x [R, dim] through expert ids[p] -> float32 [pairs, dim].
    `xq`: x's rows already quantized (by the norm kernel that made x)."""
    if xq is None:
        xq = quantize_x8(x.float().contiguous())
    counters = pe.counters[: len(pe.gate_up)]  # the last one is down's
    parts = [
        gemv_packed_grouped(xq, p, ids, xdiv, c) for p, c in zip(pe.gate_up, counters, strict=True)
    ]
    h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return gemv_packed_grouped(_act_quantized(h, fmt), pe.down, ids, 1, pe.counters[-1])


def _act_quantized(h: torch.Tensor, fmt: ExpertFormat) -> QuantizedX:
    """act(gate) * up of h [pairs, 2 hidden], quantized for down (SiLU: one launch, not two)."""
    if fmt.act == "silu":
        a, aq = silu_mul_q(h, fmt.hidden, max_rows=h.shape[0])
    else:
        a, aq = _act(h, fmt), None
    return aq if aq is not None else quantize_x8(a)


def ffn_sorted(
    x: torch.Tensor,
    sp: SortedPairs,
    xdiv: int,
    pe: PackedExperts,
    fmt: ExpertFormat,
    xq: QuantizedX | None = None,
) -> torch.Tensor:
    """Pair p's FFN: row p // xdiv of x [R, dim] through its expert -> float32 [pairs, dim],
    the pairs grouped by expert (`sp`) for the grouped int8 tensor-core GEMMs. `xq`: x's rows
    already quantized, or None."""
    if xq is None:
        xq = quantize_x8(x.float().contiguous())
    parts = [grouped_gemm(xq, sp, p, xdiv) for p in pe.gate_up]
    h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return grouped_gemm(_act_quantized(h, fmt), sp, pe.down, 1)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's k pairs: y [T * k, dim], weights [T, k] -> [T, dim]
    (a Triton kernel on CUDA, see `triton_combine`; torch's bmm elsewhere)."""
    if y.is_cuda and TRITON_COMBINE:
        return combine_cuda(y, weights)
    return WeightedRows(y, weights).total()


def expert_ffn_packed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    pe: PackedExperts,
    fmt: ExpertFormat,
    xq: QuantizedX | None = None,
    defer: bool = False,
) -> "torch.Tensor | WeightedRows":
    """Resident packed experts: x [T, dim], routing [T, k] -> float32 [T, dim]; `xq`: x's rows
    already quantized, or None. `defer`: decode rows come back as their k expert outputs with
    the weights, for the next norm's kernel to sum (one launch fewer per layer)."""
    t, k = ids.shape
    if t <= PACKED_MAX_T:
        y = ffn_pairs(x, ids.reshape(-1), k, pe, fmt, xq)
        return WeightedRows(y, weights) if defer and SUM_IN_NORM else combine(y, weights)
    return _prefill(x, weights, ids, pe, fmt, xq)


def _prefill(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    pe: PackedExperts,
    fmt: ExpertFormat,
    xq: QuantizedX | None = None,
) -> torch.Tensor:
    """Many tokens: pairs sorted by expert on the device, grouped GEMMs over the packed blocks."""
    t, k = ids.shape
    sp = sort_pairs_cuda(ids, pe.n_expert, block_rows(t * k, pe.n_expert))
    return combine(ffn_sorted(x, sp, k, pe, fmt, xq), weights)


def expert_ffn_fetched(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fetch: Callable[[int], "ExpertBlocks | PackedExperts"],
    fmt: ExpertFormat,
    n_expert: int,
) -> torch.Tensor:
    """Experts fetched one at a time (a streamed slot, a host copy) of a layer of `n_expert`:
    each is packed as it comes and computed exactly as its resident packed form would be."""

    def one(e: int) -> PackedExperts:
        b = fetch(e)
        if isinstance(b, PackedExperts):  # a streamed slot kept packed on the device
            return b
        return pack_experts(b.gate[None], b.up[None], b.down[None], fmt, 1)

    return _per_expert(x, weights, ids, one, fmt, n_expert)


def _per_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert: Callable[[int], PackedExperts],
    fmt: ExpertFormat,
    n_expert: int,
) -> torch.Tensor:
    """Experts one at a time in ascending order (each `expert(e)` used before the next call)."""
    t, k = ids.shape
    order, experts, counts = group_by_expert(ids)
    tokens = order // k
    y = torch.empty(t * k, fmt.dim, dtype=torch.float32, device=x.device)
    bm = block_rows(t * k, n_expert)  # the tiles the resident launch takes: the same bits
    start = 0
    for e, n in zip(experts, counts, strict=True):
        pairs = order[start : start + n]
        rows = x[tokens[start : start + n]]
        pe = expert(e)
        zero = torch.zeros(n, dtype=torch.int64, device=x.device)
        if t <= PACKED_MAX_T:
            y[pairs] = ffn_pairs(rows, zero, 1, pe, fmt)
        else:
            y[pairs] = ffn_sorted(rows, sort_pairs(zero, 1, bm), 1, pe, fmt)
        start += n
    return combine(y, weights)
