"""Packed experts on the GPU path: stacked expert planes, grouped dp4a GEMVs with the expert id
read on the device, the packed expert FFN against the float oracle, and bit-equality between
resident (grouped) and fetched (packed one at a time) experts.

The layout test is plain torch (runs everywhere). Kernel tests run on CUDA (marked `gpu`) or on
CPU tensors under TRITON_INTERPRET=1. Tolerances: a grouped pair against `gemv_q8x_reference`
as for the plain packed GEMV (1e-5 Q8_0, 2e-4 K-quants); the whole FFN against the float oracle
5e-2 relative (activations are rounded to int8 twice, before the input projections and before
down; ~1-2 % each on random data); the prefill path (the same int8 activations, summed
without split-K) 2e-2.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.moe import ExpertBlocks, ExpertFormat, expert_ffn_reference, route_topk
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.repack import expert_planes, pack_blocks, pack_expert_blocks
from tests.perf.make_synthetic import random_rows
from tests.triton_env import CUDA, DEVICE, INTERPRET, needs_triton

E, K_USED = 6, 2
D, H = (256, 256) if INTERPRET or not CUDA else (1024, 512)


def _stack(qtype: QT, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    raw = np.stack([random_rows(qtype, rows, cols, rng) for _ in range(E)])
    return torch.from_numpy(raw)


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_stacked_planes_equal_per_expert_packing(name):
    raw = _stack(QT[name], 40, 512, 1)
    p = pack_expert_blocks(raw, QuantType[name], 40, 512)
    assert p.nbytes == raw.numel()
    for e in range(E):
        one = pack_blocks(raw[e], QuantType[name], 40, 512)
        mine = expert_planes(p, e)
        assert one.planes.keys() == mine.planes.keys()
        for f in one.planes:
            assert torch.equal(one.planes[f], mine.planes[f]), (e, f)


@needs_triton  # (kernels.moe.packed imports the kernels; the chunking itself is plain torch)
@pytest.mark.parametrize(("gate", "down", "chunk"), [("Q4_K", "Q6_K", 4), ("Q8_0", "Q8_0", 5)])
def test_planes_packed_in_chunks_stack_into_the_layers(gate, down, chunk):
    """A mapped layer is packed a few experts at a time (`offload.mapped.map_packed_layer`):
    the chunks' planes, stacked, are the whole layer's, byte for byte (a last chunk shorter)."""
    from localllm.kernels.moe.packed import pack_expert_planes, pack_planes_in_chunks

    fmt = ExpertFormat(QuantType[gate], QuantType[gate], QuantType[down], 256, 256, "silu")
    g, u, d = (_stack(QT[t], 256, 256, s) for t, s in ((gate, 1), (gate, 2), (down, 3)))
    gu, dn = pack_expert_planes(g, u, d, fmt)
    whole = (*gu, dn)
    parts = list(pack_planes_in_chunks(g, u, d, fmt, "cpu", chunk))
    assert [i for i, _ in parts] == list(range(0, E, chunk))
    for k, want in enumerate(whole):
        for f, plane in want.planes.items():
            got = torch.cat([ps[k].planes[f] for _, ps in parts])
            assert torch.equal(got, plane), (k, f)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_grouped_gemv_pairs_match_reference(name):
    """Pairs with repeated and unordered expert ids, rows shared through xdiv, two calls on one
    counter buffer (each call must leave the counters at zero)."""
    from localllm.kernels.quant.q8x_reference import gemv_q8x_reference
    from localllm.kernels.quant.triton_packed import (
        gemv_packed_grouped,
        grouped_counters,
        quantize_x8,
    )

    qt, n, k = QuantType[name], 72, 512
    raw = _stack(QT[name], n, k, 2)
    p = pack_expert_blocks(raw.to(DEVICE), qt, n, k)
    counters = grouped_counters(p, 8)
    for ids_list, xdiv in (([3, 0, 3, 5], 2), ([1, 4, 2, 2, 0, 5, 3, 1], 1)):
        ids = torch.tensor(ids_list, device=DEVICE)
        x = torch.randn(len(ids_list) // xdiv, k)
        y = gemv_packed_grouped(quantize_x8(x.to(DEVICE)), p, ids, xdiv, counters)
        assert y.shape == (len(ids_list), n)
        tol = 1e-5 if name == "Q8_0" else 2e-4
        for pair, e in enumerate(ids_list):
            ref = gemv_q8x_reference(x[pair // xdiv : pair // xdiv + 1], raw[e], qt, n, k)
            assert _rel(y[pair : pair + 1], ref) < tol, (pair, e)
        assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("tokens", "k", "dim"), [(1, 8, 2048), (5, 2, 100), (3, 4, 3000)])
def test_combine_kernel_matches_weighted_sum(tokens, k, dim):
    """The Triton weighted sum of each token's k outputs (decode's and prompts' `combine` on
    CUDA) against the float64 sum; rows past one program's block and a width not a power of 2."""
    from localllm.kernels.moe.triton_combine import combine_cuda

    gen = torch.Generator().manual_seed(tokens * k + dim)
    y = torch.randn(tokens * k, dim, generator=gen)
    w = torch.rand(tokens, k, generator=gen)
    got = combine_cuda(y.to(DEVICE), w.to(DEVICE))
    want = torch.einsum("tk,tkd->td", w.double(), y.double().view(tokens, k, dim))
    assert got.shape == (tokens, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_dequantize_experts_t_equals_each_expert(name):
    from localllm.kernels.quant.triton_packed import dequantize_experts_t, dequantize_packed_t

    qt, n, k = QuantType[name], 72, 512
    p = pack_expert_blocks(_stack(QT[name], n, k, 3).to(DEVICE), qt, n, k)
    got = dequantize_experts_t(p, 2, 5)
    assert got.shape == (3, k, n) and got.dtype == torch.bfloat16
    for j, e in enumerate(range(2, 5)):
        assert torch.equal(got[j], dequantize_packed_t(expert_planes(p, e)))


def _layer(gate_t: str, down_t: str, seed: int):
    gate = _stack(QT[gate_t], H, D, seed)
    up = _stack(QT[gate_t], H, D, seed + 1)
    down = _stack(QT[down_t], D, H, seed + 2)
    fmt = ExpertFormat(QuantType[gate_t], QuantType[gate_t], QuantType[down_t], D, H)
    return gate, up, down, fmt


@pytest.mark.gpu
@needs_triton
# (Q5_0: packed widened to Q8_0, GLM-4.5-Air Q4_K_M's ffn_down_exps)
@pytest.mark.parametrize(
    ("gate_t", "down_t"), [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q4_K", "Q5_0")]
)
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_packed_ffn_matches_oracle_and_fetched_bit_for_bit(gate_t, down_t, tokens):
    from localllm.kernels.moe.packed import (
        PACKED_MAX_T,
        expert_ffn_fetched,
        expert_ffn_packed,
        pack_experts,
        packable,
    )

    gate, up, down, fmt = _layer(gate_t, down_t, 10 * tokens)
    assert packable(fmt, widen=True)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=gen)
    w, ids = route_topk(torch.randn(tokens, E, generator=gen), K_USED, True)
    dev = [t.to(DEVICE) for t in (gate, up, down)]
    pe = pack_experts(*dev, fmt, K_USED)
    got = expert_ffn_packed(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), pe, fmt)
    want = expert_ffn_reference(x, w, ids, gate, up, down, fmt)
    assert got.shape == (tokens, D) and want.abs().max() > 0.05
    assert _rel(got, want) < (5e-2 if tokens <= PACKED_MAX_T else 2e-2)
    pending = expert_ffn_packed(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), pe, fmt, defer=True)
    if tokens <= PACKED_MAX_T:  # decode rows: the k outputs unsummed, for the next norm
        assert pending.rows.shape == (tokens * K_USED, D) and torch.equal(
            pending.weights, w.to(DEVICE)
        )
        torch.testing.assert_close(pending.total(), got, rtol=1e-6, atol=1e-6)
    else:  # prompts are summed here
        assert torch.equal(pending, got)
    fetched = []

    def fetch(e):
        fetched.append(e)
        return ExpertBlocks(dev[0][e], dev[1][e], dev[2][e])

    again = expert_ffn_fetched(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), fetch, fmt, E)
    assert torch.equal(got, again)  # where the experts live must not change a bit
    assert fetched == sorted(set(ids.reshape(-1).tolist()))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_packed_decode_replays_in_a_cuda_graph():
    """The decode path keeps expert ids on the device: captured once, replayed with new routing,
    it equals the eager call."""
    from localllm.kernels.moe.packed import expert_ffn_packed, pack_experts

    gate, up, down, fmt = _layer("Q4_K", "Q6_K", 5)
    pe = pack_experts(gate.cuda(), up.cuda(), down.cuda(), fmt, K_USED)
    x = torch.randn(2, D, device="cuda")
    logits = torch.randn(2, E, device="cuda")

    def step():
        w, ids = route_topk(logits, K_USED, True)
        return expert_ffn_packed(x, w, ids, pe, fmt)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(2, D, device="cuda", generator=gen))
        logits.copy_(torch.randn(2, E, device="cuda", generator=gen))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


@needs_triton
def test_a_layer_packed_in_chunks_into_mapped_memory_is_pack_experts():
    """`map_packed_layer` (plain tensors standing in for the mapped buffer on a CPU run) gives
    `pack_experts`' planes and split-K counters of the same shapes."""
    from localllm.kernels.moe.packed import pack_experts
    from localllm.offload.mapped import map_packed_layer

    def plain(specs, device):
        return {n: torch.empty(shape, dtype=t, device=device) for n, (shape, t) in specs.items()}

    fmt = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, 256, 256, "silu")
    g, u, d = (_stack(t, 256, 256, s) for t, s in ((QT.Q4_K, 4), (QT.Q4_K, 5), (QT.Q6_K, 6)))
    want = pack_experts(g.to(DEVICE), u.to(DEVICE), d.to(DEVICE), fmt, K_USED)
    got = map_packed_layer(g, u, d, fmt, K_USED, DEVICE, chunk=4, empty=plain)
    for a, b in zip((*got.gate_up, got.down), (*want.gate_up, want.down), strict=True):
        assert (a.qtype, a.n, a.k) == (b.qtype, b.n, b.k)
        for f in b.planes:
            assert torch.equal(a.planes[f], b.planes[f]), f
    assert [c.shape for c in got.counters] == [c.shape for c in want.counters]
