"""Experts' Q5_0 blocks packed as they are (`widen.NATIVE_Q5_0`), not widened to Q8_0.

The layout (round trip, byte count, per-expert planes, `pack_into`) is plain torch and runs
everywhere. The kernels build Q8_0's int8 words from the Q5_0 planes in registers
(`triton_dp4a._q8_words`), so the grouped and plain GEMVs (decode), the grouped GEMM (prefill)
and the bf16 dequant over native planes must equal the same kernels over the widened planes bit
for bit, and the packed expert FFN (resident, fetched, from a slot pool) the widened FFN's bits;
each also against its float64 reference (1e-5 relative, as Q8_0's). Kernel tests run on CUDA
(marked `gpu`) or on CPU tensors under TRITON_INTERPRET=1. K = 1408: GLM-4.5-Air's down experts.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.moe import ExpertBlocks, ExpertFormat, expert_ffn_reference, route_topk
from localllm.kernels.quant import QuantType, widen
from localllm.kernels.quant.repack import (
    expert_planes,
    pack_blocks,
    pack_expert_blocks,
    pack_into,
    packs,
    unpack_blocks,
)
from tests.perf.make_synthetic import random_rows
from tests.triton_env import DEVICE, needs_triton

E, N, K = 5, 72, 1408
Q5 = QuantType.Q5_0


def _stack(rows: int, cols: int, seed: int, qt: QT = QT.Q5_0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([random_rows(qt, rows, cols, rng) for _ in range(E)]))


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setattr(widen, "NATIVE_Q5_0", True)


def _both(raw: torch.Tensor, n: int = N, k: int = K):
    """(native, widened) stacked planes of raw Q5_0 experts, on DEVICE."""
    dev = raw.to(DEVICE)
    widen.NATIVE_Q5_0 = True
    try:
        mine = pack_expert_blocks(dev, Q5, n, k)
    finally:
        widen.NATIVE_Q5_0 = False
    return mine, pack_expert_blocks(dev, Q5, n, k)


def test_q5_0_planes_round_trip_and_byte_count():
    raw = _stack(N, K, 1)[0]
    p = pack_blocks(raw, Q5, N, K)
    assert p.nbytes == raw.numel() and set(p.planes) == {"d", "qh", "qs"}
    assert p.planes["qs"].shape == (K // 32 * 4, N) and p.planes["qh"].shape == (K // 32, N)
    assert torch.equal(unpack_blocks(p), raw)


def test_switch_decides_whether_experts_pack_natively(native):
    raw = _stack(N, K, 2)
    assert packs(Q5, K) and not packs(Q5, K + 16)
    p = pack_expert_blocks(raw, Q5, N, K)
    assert p.qtype == Q5 and p.nbytes == raw.numel()
    assert widen.widened_nbytes(Q5, raw.numel()) == raw.numel()
    for e in range(E):
        one, mine = pack_blocks(raw[e], Q5, N, K), expert_planes(p, e)
        assert all(torch.equal(one.planes[f], mine.planes[f]) for f in one.planes), e
    widen.NATIVE_Q5_0 = False  # (monkeypatch restores it too)
    assert not packs(Q5, K)
    assert pack_expert_blocks(raw, Q5, N, K).qtype == QuantType.Q8_0
    assert widen.widened_nbytes(Q5, raw.numel()) == raw.numel() // 22 * 34


def test_pack_into_fills_a_slot_byte_for_byte(native):
    """Slot pools write streamed experts' 22-byte blocks (words not 4-byte aligned in the file)
    into their planes: the same planes `pack_expert_blocks` makes, rows split in two calls."""
    raw = _stack(N, K, 3)
    want = pack_expert_blocks(raw, Q5, N, K)
    dst = pack_expert_blocks(torch.zeros_like(raw), Q5, N, K)
    for e in range(E):
        pack_into(dst, e, raw[e, :40], row0=0)
        pack_into(dst, e, raw[e, 40:], row0=40)
    assert all(torch.equal(dst.planes[f], want.planes[f]) for f in want.planes)


@pytest.mark.gpu
@needs_triton
def test_gemvs_over_native_planes_equal_the_widened_bit_for_bit():
    """Grouped pairs (repeated, unordered experts; rows shared through xdiv; one counter buffer
    for both calls) and a plain launch over one expert (with its L2 prefetch of small weights)."""
    from localllm.kernels.quant.q8x_reference import gemv_q8x_reference
    from localllm.kernels.quant.triton_packed import (
        gemv_packed,
        gemv_packed_grouped,
        grouped_counters,
        quantize_x8,
    )

    raw = _stack(N, K, 4)
    mine, wide = _both(raw)
    counters = grouped_counters(wide, 8)
    for ids_list, xdiv in (([3, 0, 3, 4], 2), ([1, 4, 2, 2, 0, 3, 3, 1], 1)):
        ids = torch.tensor(ids_list, device=DEVICE)
        xq = quantize_x8(torch.randn(len(ids_list) // xdiv, K).to(DEVICE))
        got = gemv_packed_grouped(xq, mine, ids, xdiv, counters)
        assert torch.equal(got, gemv_packed_grouped(xq, wide, ids, xdiv, counters))
        assert int(counters.abs().sum()) == 0
    x = torch.randn(3, K)
    got = gemv_packed(x.to(DEVICE), expert_planes(mine, 2))
    assert torch.equal(got, gemv_packed(x.to(DEVICE), expert_planes(wide, 2)))
    assert _rel(got, gemv_q8x_reference(x, raw[2], Q5, N, K)) < 1e-5


@pytest.mark.gpu
@needs_triton
def test_grouped_gemm_and_dequant_over_native_planes_equal_the_widened():
    from localllm.kernels.moe.grouped import grouped_gemm, grouped_gemm_reference
    from localllm.kernels.moe.pairs import sort_pairs
    from localllm.kernels.quant.triton_packed import dequantize_experts_t, quantize_x8

    raw = _stack(N, K, 5)
    mine, wide = _both(raw)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(19, K, generator=gen)
    ids = torch.randint(0, E - 1, (38,), generator=gen)  # an expert without rows
    sp = sort_pairs(ids.to(DEVICE), E, 16)
    xq = quantize_x8(a.to(DEVICE))
    got = grouped_gemm(xq, sp, mine, 2)
    assert torch.equal(got, grouped_gemm(xq, sp, wide, 2))
    assert _rel(got, grouped_gemm_reference(a, ids, raw, Q5, 2)) < 1e-5
    assert torch.equal(dequantize_experts_t(mine, 1, 4), dequantize_experts_t(wide, 1, 4))


def _glm_layer(seed: int):
    """A GLM-4.5-Air Q4_K_M-like layer at small scale: Q4_K gate/up, Q5_0 down 1408 wide."""
    d = 256
    gate, up = _stack(K, d, seed, QT.Q4_K), _stack(K, d, seed + 1, QT.Q4_K)
    down = _stack(d, K, seed + 2)
    return gate, up, down, ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, Q5, d, K, "silu")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_packed_ffn_native_equals_widened_and_fetched(tokens):
    from localllm.kernels.moe.packed import expert_ffn_fetched, expert_ffn_packed, pack_experts

    gate, up, down, fmt = _glm_layer(10 * tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, fmt.dim, generator=gen)
    w, ids = route_topk(torch.randn(tokens, E, generator=gen), 2, True)
    dev = [t.to(DEVICE) for t in (gate, up, down)]
    args = (x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE))
    wide = expert_ffn_packed(*args, pack_experts(*dev, fmt, 2), fmt)
    widen.NATIVE_Q5_0 = True
    try:
        pe = pack_experts(*dev, fmt, 2)
        assert pe.down.qtype == Q5
        got = expert_ffn_packed(*args, pe, fmt)
        fetched = expert_ffn_fetched(
            *args, lambda e: ExpertBlocks(dev[0][e], dev[1][e], dev[2][e]), fmt, E
        )
    finally:
        widen.NATIVE_Q5_0 = False
    assert torch.equal(got, wide) and torch.equal(fetched, wide)
    want = expert_ffn_reference(x, w, ids, gate, up, down, fmt)
    assert _rel(got, want) < 5e-2


@pytest.mark.gpu
@needs_triton
def test_slot_pool_takes_native_q5_0_experts(native):
    """With the switch a slot pool takes GLM-4.5-Air's format (widened types it cannot: it fills
    planes byte for byte); both fills give the resident layer's planes and FFN bits."""
    from localllm.kernels.moe.packed import expert_ffn_packed, pack_experts, packable
    from localllm.kernels.moe.slot_pool import PackedSlotPool

    gate, up, down, fmt = _glm_layer(7)
    assert packable(fmt)
    resident = pack_experts(*(t.to(DEVICE) for t in (gate, up, down)), fmt, 2)
    pool = PackedSlotPool(fmt, 3, 2, torch.device(DEVICE))
    for slot, e in ((0, 4), (1, 1), (2, 3)):
        raw = torch.cat([t[e].reshape(-1) for t in (gate, up, down)])
        fill = pool.fill_raw if slot != 1 else pool.fill_mapped
        fill(slot, raw)
    pe = pool.view(0)
    for a, b in zip((*pe.gate_up, pe.down), (*resident.gate_up, resident.down), strict=True):
        ref = expert_planes(b, 4)
        assert all(torch.equal(a.planes[f][0], ref.planes[f]) for f in ref.planes)
    x = torch.randn(2, fmt.dim).to(DEVICE)
    w, ids = route_topk(torch.randn(2, E), 2, True)
    ids = torch.tensor([[4, 1], [3, 4]])
    slots = torch.tensor([[0, 1], [2, 0]])
    want = expert_ffn_packed(x, w.to(DEVICE), ids.to(DEVICE), resident, fmt)
    got = expert_ffn_packed(x, w.to(DEVICE), slots.to(DEVICE), pool.pe, fmt)
    assert torch.equal(got, want)
