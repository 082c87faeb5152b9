"""Host experts split between the GPU and the CPU (`engine.moe.split`), on CPU tensors: each
token's first k - c experts go to the GPU part with their own weights, the last c to the native
CPU kernels, and the sum is those two parts' sum (the GPU test is in test_gpu_residency.py)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.moe.split import SPLIT_MAX_T, SplitExperts, cpu_count
from localllm.kernels.cpu.rows_call import RowsCall
from localllm.kernels.moe import ExpertFormat, expert_ffn_reference
from localllm.kernels.quant import QuantType
from localllm.offload.expert_stats import ExpertStats
from tests.offload.native_layers import TYPES, native_kernels, random_layer
from tests.perf.make_synthetic import random_rows

_layer = random_layer


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return native_kernels(tmp_path_factory)


def test_cpu_count_keeps_both_sides_busy():
    assert [cpu_count(8, s) for s in (0.0, 0.2, 0.375, 0.5, 0.99)] == [1, 1, 3, 4, 7]
    assert cpu_count(2) == 1 and [cpu_count(4, 0.375, layer) for layer in range(4)] == [1, 2, 1, 2]
    # a fraction of an expert: the layers alternate, averaging the share over layer pairs
    assert [cpu_count(8, 0.4375, layer) for layer in range(6)] == [3, 4, 3, 4, 3, 4]
    assert [cpu_count(8, 0.3125, layer) for layer in range(4)] == [2, 3, 2, 3]


@pytest.mark.parametrize("tokens", [1, 3, SPLIT_MAX_T])
def test_split_sums_the_gpu_share_and_the_cpu_share(kernels, tokens):
    g, u, d = _layer(seed=tokens)
    qt = tuple(QuantType(t) for t in TYPES)
    k, dim = 8, 256
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, dim, generator=gen)
    ids = torch.stack([torch.randperm(12, generator=gen)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    split = SplitExperts(kernels, (g, u, d), qt, "silu", dim, k)
    split.stats = ExpertStats()
    c = split.cpu
    seen = []

    def gpu(x, xq, wg, ig):  # the "GPU" share on the same kernels, recording what it got
        seen.append((wg.clone(), ig.clone()))
        return kernels.moe_ffn(x, wg, ig, g, u, d, qt, "silu")

    y = split.ffn(x, None, w, ids, gpu)
    assert torch.equal(seen[0][1], ids[:, : k - c]) and torch.equal(seen[0][0], w[:, : k - c])
    gp = kernels.moe_ffn(x, w[:, : k - c], ids[:, : k - c], g, u, d, qt, "silu")
    cpu = kernels.moe_ffn(x, w[:, k - c :], ids[:, k - c :], g, u, d, qt, "silu")
    assert torch.equal(y, gp + cpu)
    assert split.host_rows == tokens and split.timing.steps == 1 and split.timing.cpu_seconds > 0
    st = split.stats  # the CPU's pairs count as served where they are
    assert st.host_rows == tokens and st.lookups == st.hits == st.cpu_pairs == tokens * c
    # against the dense oracle over all k experts (int8 activations: ~1 %)
    want = expert_ffn_reference(x, w, ids, g, u, d, ExpertFormat(*qt, dim, 512, "silu"))
    rel = ((y.double() - want.double()).norm() / want.double().norm()).item()
    assert want.abs().max() > 1e-3 and rel < 2e-2
    assert split.takes(ids) and not split.takes(ids.repeat(SPLIT_MAX_T + 1, 1))


def test_with_slots_the_cpu_takes_the_experts_the_slots_miss(kernels):
    """Where the GPU's share has device slots, each token's experts are reordered hits first,
    misses last (each in routing order), so the CPU's c computes misses where a token has them;
    the sum is still over all k experts with their own weights."""
    g, u, d = _layer(seed=5)
    qt = tuple(QuantType(t) for t in TYPES)
    k, dim, t = 8, 256, 3
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, dim, generator=gen)
    ids = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 7], [11, 10, 9, 8, 7, 6, 5, 4], [3, 8, 1, 9, 0, 2, 4, 5]]
    )
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    split = SplitExperts(kernels, (g, u, d), qt, "silu", dim, k)
    c = split.cpu
    slot_of = torch.full((12,), -1, dtype=torch.int32)
    slot_of[[0, 2, 4, 6, 8, 10, 1, 9, 3]] = torch.arange(9, dtype=torch.int32)  # 5, 7, 11 missed
    split.slot_of = slot_of
    seen = []

    def gpu(x, xq, wg, ig):
        seen.append((wg.clone(), ig.clone()))
        return kernels.moe_ffn(x, wg, ig, g, u, d, qt, "silu")

    y = split.ffn(x, None, w, ids, gpu)
    order = torch.tensor([[0, 1, 2, 3, 4, 6, 5, 7], [1, 2, 3, 5, 7, 0, 4, 6],
                          [0, 1, 2, 3, 4, 5, 6, 7]])  # fmt: skip
    mine = ids.gather(1, order)
    assert mine[0, -2:].tolist() == [5, 7] and mine[1, -3:].tolist() == [11, 7, 5]
    assert torch.equal(seen[0][1], mine[:, : k - c])
    assert torch.equal(seen[0][0], w.gather(1, order)[:, : k - c])
    wo = w.gather(1, order)
    gp = kernels.moe_ffn(x, wo[:, : k - c], mine[:, : k - c], g, u, d, qt, "silu")
    cpu = kernels.moe_ffn(x, wo[:, k - c :], mine[:, k - c :], g, u, d, qt, "silu")
    assert torch.equal(y, gp + cpu)
    want = expert_ffn_reference(x, w, ids, g, u, d, ExpertFormat(*qt, dim, 512, "silu"))
    rel = ((y.double() - want.double()).norm() / want.double().norm()).item()
    assert rel < 2e-2


@pytest.mark.parametrize("types", [TYPES, (QT.Q8_0,) * 3, (QT.Q6_K, QT.Q4_K, QT.Q8_0)])
def test_rows_call_equals_moe_ffn_bit_for_bit(kernels, types):
    """The prepared per-pair call (each pair its own group, in routing order) gives moe_ffn's
    bits, rows sharing an expert included; bad routing is refused before any kernel runs."""
    rng = np.random.default_rng(3)
    shapes = ((512, 256), (512, 256), (256, 512))
    g, u, d = (
        torch.from_numpy(np.stack([random_rows(types[i], r, c, rng) for _ in range(6)]))
        for i, (r, c) in enumerate(shapes)
    )
    qt = tuple(QuantType(t) for t in types)
    call = RowsCall(kernels, (g, u, d), qt, "silu", max_rows=4, k=3)
    gen = torch.Generator().manual_seed(1)
    for t in (1, 2, 4):
        x = torch.randn(t, 256, generator=gen)
        ids = torch.tensor([[5, 0, 2], [2, 5, 1], [0, 3, 4], [1, 2, 5]][:t])
        w = torch.rand(t, 3, generator=gen)
        y = torch.empty(t, 256)
        call.run(t, x.data_ptr(), w.data_ptr(), ids.reshape(-1).tolist(), y.data_ptr(), 2)
        assert torch.equal(y, kernels.moe_ffn(x, w, ids, g, u, d, qt, "silu"))
    for t, bad in ((1, [0, 1, 6]), (1, [0, -1, 2]), (5, [0] * 15), (1, [0, 1])):
        with pytest.raises(ValueError, match="bad routing"):
            call.run(t, x.data_ptr(), w.data_ptr(), bad, y.data_ptr(), 2)


def test_the_plans_split_share_sets_each_layers_cpu_count(kernels, tmp_path):
    """`split_share` (flag, environment, document) reaches every split layer: its CPU count is
    the share's, over device slots too; unset, the defaults (SPLIT_CPU_SHARE without slots,
    SPLIT_CPU_SHARE_SLOTS with them)."""
    from types import SimpleNamespace

    from localllm.engine.gguf import open_gguf
    from localllm.engine.loader import build_model
    from localllm.engine.moe.block import moe_blocks
    from localllm.engine.moe.sources import _split
    from localllm.engine.moe.split import SPLIT_CPU_SHARE, SPLIT_CPU_SHARE_SLOTS
    from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0, n_expert=16, n_used=8)
    g = open_gguf(write_moe_gguf(tmp_path / "moe.gguf", spec))
    try:
        for share, slots, want in (
            (0.25, False, 0.25),
            (0.75, True, 0.75),
            (None, False, SPLIT_CPU_SHARE),
            (None, True, SPLIT_CPU_SHARE_SLOTS),
        ):
            blocks = moe_blocks(build_model(g))
            lru = SimpleNamespace(slot_of=torch.zeros(16, dtype=torch.int64)) if slots else None
            for b in blocks:  # (the mapped side is the GPU's: only its slot map is read here)
                b.mapped = SimpleNamespace(lru=lru, n_used=b.n_used)
            _split(blocks, share)
            assert [b.split.cpu for b in blocks] == [cpu_count(8, want, b.layer) for b in blocks]
            assert all(b.mapped.n_used == 8 - b.split.cpu for b in blocks)
            assert all((b.split.slot_of is not None) == slots for b in blocks)
    finally:
        g.close()
