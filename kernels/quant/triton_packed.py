"""Host side of the packed dp4a kernels: activation quantization, `gemv_packed`,
`dequantize_packed_t` and launch geometry (their plain-torch oracles: `q8x_reference`).

Imported only where CUDA exists (or under TRITON_INTERPRET=1 in tests). `ASM` (the real dp4a
instruction) is used whenever the tensors are on CUDA; CPU tensors mean the triton interpreter.
"""

from dataclasses import dataclass

import torch
import triton

from localllm.kernels import pdl
from localllm.kernels.quant.repack import PackedBlocks
from localllm.kernels.quant.triton_dp4a import (
    _gemv_q4k_packed,
    _gemv_q6k_packed,
    _gemv_q8_0_packed,
    _quant_x8,
)
from localllm.kernels.quant.triton_lora_tail import tail_args
from localllm.kernels.quant.triton_unpack import _deq_q4k_packed, _deq_q6k_packed, _deq_q8_0_packed
from localllm.kernels.quant.types import QuantType, block_geometry

# Programs per launch: many one-warp programs keep enough loads in flight on an H100/H200's 132
# SMs (H200 sweep, tests/perf/bench_gpu.py packed: 1 warp x 64 rows, ~2,000 programs, was best
# or within 10 % for every Llama-3-8B shape and type; above ~1,000 row tiles split-K only costs).
SM_TARGET = 2048
NO_SPLIT_TILES = 1024
# Matrices this small take two warps per 64-row program (H200, one token: Qwen3-30B-A3B's experts
# in grouped launches, tests/perf/bench_grouped.py, Q6_K down 7.17 us against 8.67 with one
# warp, Q4_K down 6.32 against 6.66, gate_up 8.05 against 8.15; its attention projections,
# bench_gpu.py packed moe, Q6_K v 4.5 against 5.3, qkv 5.6 against 5.8; MoE decode 431.5 t/s
# against 422.1). Llama-3-8B's projections (9-66 MB) keep one.
SMALL_BYTES = 8 << 20
MAX_ROWS = 4  # activation rows per launch: Q6_K with 8 spills registers (50x slower on the H200)
# Programmatic dependent launch for these GEMVs, and their L2 prefetch of the first weight block
# while the previous kernel runs (`kernels/pdl.py`; tests/perf/h200_session.sh `pdlab` A/Bs them)
GEMV_PDL = True
GEMV_PREFETCH = True
# Prefetch only matrices this small: it hid the Qwen3-30B-A3B attention projections' first
# round trip (MoE decode 404 -> 415 t/s) but slowed Llama-3-8B's 9-66 MB GEMVs (410 -> 396)
PREFETCH_MAX_BYTES = 8 << 20
# Let the next kernel be placed only after the weights are read (else at the start: the next
# kernels' programs, placed and prefetching a chain ahead, slowed Llama-3-8B decode 4 %)
GEMV_LATE_TRIGGER = True
# Software-pipelined weight loads: a program's loop over its K chunk's blocks runs with this many
# cp.async stages (triton's pipeliner; 1: plain loads, the kernels as before, PTX identical).
# With more stages a program keeps its next blocks in flight, so fewer split-K programs (less
# partial-sum traffic, a shorter reduction tail) may stream as fast: PIPE_SM_TARGET programs
# per launch then. Off: slower on an H100 (2026-12-07 21:57 UTC, 8B tg128 387 t/s plain, 324-371
# at 2 stages, 355-358 at 3, with 264, 528 or 2,048 programs; tests/perf/results/gpu-kernels.md).
GEMV_STAGES = 1
PIPE_SM_TARGET = SM_TARGET


@dataclass(frozen=True, slots=True)
class QuantizedX:
    """Activation rows as int8 codes: words [M, K/4] (4 codes each), scale [M, K/32] float32,
    integer code sums per 16 [M, K/16], dx * code sum per 32 [M, K/32] float32."""

    words: torch.Tensor
    scale: torch.Tensor
    sum16: torch.Tensor
    xsum: torch.Tensor


@dataclass(frozen=True, slots=True)
class PackedConfig:
    """Weight rows per program, warps, blocks (super-blocks for K-quants) per program, and the
    cp.async stages of a program's loop over them (1: none)."""

    block_n: int
    num_warps: int
    blocks_per_program: int
    stages: int = 1


def packed_config(
    qtype: QuantType, n: int, k: int, block_n: int = 64, warps: int | None = None
) -> PackedConfig:
    """Split K until the launch has about SM_TARGET programs (N alone gives too few for the
    4096-row projections; PIPE_SM_TARGET with GEMV_STAGES > 1, whose stages a program with
    more than one block takes). Warps: two per program for matrices up to SMALL_BYTES, else
    one."""
    block, block_bytes = block_geometry(qtype)
    nb = k // block
    tiles = triton.cdiv(n, block_n)
    target = PIPE_SM_TARGET if GEMV_STAGES > 1 else SM_TARGET
    split = 1 if tiles >= NO_SPLIT_TILES else max(1, min(nb, triton.cdiv(target, tiles)))
    if warps is None:
        warps = 2 if n * nb * block_bytes <= SMALL_BYTES else 1
    spb = triton.cdiv(nb, split)
    return PackedConfig(block_n, warps, spb, GEMV_STAGES if spb > 1 else 1)


def empty_quantized(m: int, k: int, device: torch.device) -> QuantizedX:
    """Uninitialised QuantizedX buffers for M rows of K values (a kernel fills them)."""
    return QuantizedX(
        torch.empty(m, k // 4, dtype=torch.int32, device=device),
        torch.empty(m, k // 32, dtype=torch.float32, device=device),
        torch.empty(m, k // 16, dtype=torch.int32, device=device),
        torch.empty(m, k // 32, dtype=torch.float32, device=device),
    )


def quantized_out(rows: int, d: int, quant: bool, like: torch.Tensor):
    """For a kernel that quantizes its own output rows [rows, d]: (QuantizedX buffers, or None
    when not asked or the row splits into no whole 32-value groups; the four kernel arguments,
    the output `like` standing in for absent buffers)."""
    if not quant or d % 32:
        return None, (like, like, like, like)
    xq = empty_quantized(rows, d, like.device)
    return xq, (xq.words, xq.scale, xq.sum16, xq.xsum)


def quantize_x8(x: torch.Tensor) -> QuantizedX:
    """float32 x [M, K] (K a multiple of 32) -> QuantizedX (round half up, codes in -127..127)."""
    m, k = x.shape
    xq = empty_quantized(m, k, x.device)
    g = 16
    _quant_x8[(m, triton.cdiv(k // 32, g))](
        x, xq.words, xq.scale, xq.sum16, xq.xsum, k, G=g, RN=x.is_cuda, num_warps=4,
        **pdl.launch_options(pdl.enabled(x)),
    )  # fmt: skip
    return xq


def split_counters(p: PackedBlocks, cfg: PackedConfig) -> torch.Tensor:
    """Zeroed per-column-tile counters for a split-K launch (they reset themselves after use, so
    one buffer serves every call on one stream, CUDA-graph replays included)."""
    return torch.zeros(triton.cdiv(p.n, cfg.block_n), dtype=torch.int32, device=p.device)


def gemv_packed(
    x: torch.Tensor,
    p: PackedBlocks,
    cfg: PackedConfig | None = None,
    counters: torch.Tensor | None = None,
    xq: QuantizedX | None = None,
    lora=None,
) -> torch.Tensor:
    """float32 x [M, K] (M <= 8) @ W.T for a packed weight -> float32 [M, N]. `xq`: x already
    quantized (`quantize_x8` or a fused kernel that produced x), used when M <= MAX_ROWS.
    `lora`: a `lora_delta.LoraTail` whose delta the kernel adds in its epilogue (M <= MAX_ROWS;
    the shrink that filled its t ran before)."""
    x = x.float().contiguous()
    m = x.shape[0]
    if lora is not None and not 0 < m <= MAX_ROWS:
        raise ValueError(f"a LoRA epilogue takes 1..{MAX_ROWS} rows, not {m}")
    if m > MAX_ROWS:  # launches of at most MAX_ROWS rows (the weight then comes from L2)
        parts = [gemv_packed(c, p, cfg, counters) for c in x.split(MAX_ROWS)]
        return torch.cat(parts)
    y = torch.empty(m, p.n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    c = cfg or packed_config(p.qtype, p.n, p.k)
    nb = p.k // block_geometry(p.qtype)[0]
    split = triton.cdiv(nb, c.blocks_per_program)
    xq = xq if xq is not None else quantize_x8(x)
    part = torch.empty(split, m, p.n, dtype=torch.float32, device=x.device) if split > 1 else y
    if counters is None:
        counters = split_counters(p, c) if split > 1 else y
    grid = (triton.cdiv(p.n, c.block_n), split)
    args = (y, part, counters, y, m, p.n, p.k, nb, 1, 1)
    _launch(xq, p, grid, args, c, split, m, moe=False, lora=lora, x=x)
    return y


def gemv_packed_grouped(
    xq: QuantizedX,
    p: PackedBlocks,
    ids: torch.Tensor,
    xdiv: int,
    counters: torch.Tensor,
    cfg: PackedConfig | None = None,
) -> torch.Tensor:
    """One GEMV per (token, choice) pair: row `pair // xdiv` of the quantized activations times
    expert `ids[pair]`'s weight (planes [E, words, N]) -> float32 [pairs, N]. `counters` holds at
    least pairs x column tiles zeros (see `grouped_counters`); the split is `packed_config`'s for
    one expert, so a pair's result does not depend on how many pairs share the launch. `cfg`
    overrides the geometry (benchmarks)."""
    pairs = ids.numel()
    y = torch.empty(pairs, p.n, dtype=torch.float32, device=ids.device)
    if pairs == 0:
        return y
    c = cfg or packed_config(p.qtype, p.n, p.k)
    nb = p.k // block_geometry(p.qtype)[0]
    split = triton.cdiv(nb, c.blocks_per_program)
    part = torch.empty(split, pairs, p.n, dtype=torch.float32, device=y.device) if split > 1 else y
    grid = (triton.cdiv(p.n, c.block_n), split, pairs)
    args = (y, part, counters, ids, 1, p.n, p.k, nb, xdiv, pairs)
    _launch(xq, p, grid, args, c, split, 1, moe=True)
    return y


def grouped_counters(p: PackedBlocks, pairs: int) -> torch.Tensor:
    """Zeroed split-K counters for grouped launches of up to `pairs` pairs (self-resetting)."""
    tiles = triton.cdiv(p.n, packed_config(p.qtype, p.n, p.k).block_n)
    return torch.zeros(pairs * tiles, dtype=torch.int32, device=p.device)


def _launch(
    xq: QuantizedX, p: PackedBlocks, grid, args, c: PackedConfig, split, m, moe: bool, lora=None,
    x=None,
):  # fmt: skip
    """Launch the type's kernel; args = (y, part, counters, ids, M, N, K, nb, xdiv, pairs);
    `lora`: the epilogue's `LoraTail` (None: none compiled in), x: the float rows (its shrink's
    when it runs inline)."""
    block, block_bytes = block_geometry(p.qtype)
    small = p.n * (p.k // block) * block_bytes <= PREFETCH_MAX_BYTES
    geo = {
        "SPLIT": split,
        "MP": triton.next_power_of_2(m),
        "BN": c.block_n,
        "ASM": xq.words.device.type == "cuda",
        "MOE": moe,
        "num_warps": c.num_warps,
        **pdl.launch_options(GEMV_PDL and pdl.enabled(xq.words)),
        "PF": GEMV_PREFETCH and small,
        "LATE": GEMV_LATE_TRIGGER,
        "STAGES": c.stages,
        **tail_args(lora, args[0], x if x is not None else args[0]),
    }
    tail = (*args, c.blocks_per_program)
    pl = p.planes
    if p.qtype == QuantType.Q4_K:
        _gemv_q4k_packed[grid](xq.words, xq.scale, xq.xsum, pl["qs"], pl["hdr"], *tail, **geo)
    elif p.qtype == QuantType.Q6_K:
        planes = (pl["ql"], pl["qh"], pl["sc"], pl["d"])
        _gemv_q6k_packed[grid](xq.words, xq.scale, xq.sum16, *planes, *tail, **geo)
    elif p.qtype == QuantType.Q8_0:  # (qh unused)
        _gemv_q8_0_packed[grid](xq.words, xq.scale, pl["qs"], pl["d"], pl["qs"], *tail, **geo)
    elif p.qtype == QuantType.Q5_0:  # experts' (`widen.NATIVE_Q5_0`): Q8_0's kernel, its words
        planes = (pl["qs"], pl["d"], pl["qh"])
        _gemv_q8_0_packed[grid](xq.words, xq.scale, *planes, *tail, **geo, Q5=True)
    else:
        raise ValueError(f"no packed GEMV for {p.qtype.name}")


def dequantize_packed_t(p: PackedBlocks, block_n: int = 64) -> torch.Tensor:
    """W^T [K, N] in bf16 from a packed weight (each value rounded once from gguf's float32)."""
    out = torch.empty(p.k, p.n, dtype=torch.bfloat16, device=p.device)
    _dequantize(p, out, 0, 1, block_n)
    return out


def dequantize_experts_t(p: PackedBlocks, e0: int, e1: int, block_n: int = 64) -> torch.Tensor:
    """W^T of experts e0..e1-1 of stacked planes ([E, words, N]) -> bf16 [e1 - e0, K, N]."""
    out = torch.empty(e1 - e0, p.k, p.n, dtype=torch.bfloat16, device=p.device)
    _dequantize(p, out, e0, e1 - e0, block_n)
    return out


def _dequantize(p: PackedBlocks, out: torch.Tensor, e0: int, ne: int, block_n: int) -> None:
    pl = p.planes
    tiles = triton.cdiv(p.n, block_n)
    nb = p.k // block_geometry(p.qtype)[0]
    if p.qtype == QuantType.Q4_K:
        grid = (tiles, nb, ne)
        _deq_q4k_packed[grid](pl["qs"], pl["hdr"], out, p.n, nb, e0, BN=block_n, num_warps=2)
    elif p.qtype == QuantType.Q6_K:
        grid = (tiles, nb, ne)
        planes = (pl["ql"], pl["qh"], pl["sc"], pl["d"])
        _deq_q6k_packed[grid](*planes, out, p.n, nb, e0, BN=block_n, num_warps=2)
    elif p.qtype in (QuantType.Q8_0, QuantType.Q5_0):
        bb = 4 if nb % 4 == 0 else 1
        grid = (tiles, nb // bb, ne)
        q5 = p.qtype == QuantType.Q5_0
        args = (pl["qs"], pl["d"], pl["qh" if q5 else "qs"], out, p.n, nb, e0)
        _deq_q8_0_packed[grid](*args, BN=block_n, BB=bb, Q5=q5, num_warps=2)
    else:
        raise ValueError(f"no packed dequant for {p.qtype.name}")
