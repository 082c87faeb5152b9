"""Mapped host experts with a device cache (`offload.mapped_experts`): the grouped GEMVs reading
each pair's planes through an address table give the bits of the plain resident launch whatever
is cached; the kernels really read the slot of a cached expert; re-ranking caches the hottest
experts and accounts the routing.

Runs on CUDA (marked `gpu`, with real mapped host memory) or on CPU tensors under
TRITON_INTERPRET=1 (the "host copy" is then a plain clone).
"""

import dataclasses
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.moe import ExpertFormat, route_topk
from localllm.kernels.quant import QuantType
from localllm.offload.expert_cache import ExpertStats
from tests.perf.make_synthetic import random_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)"
    ),
]
E, K_USED, D, H = 8, 2, 256, 256


def _clone_mapper(pe):
    """The host copy on a CPU run: planes cloned (distinct addresses, same bytes)."""
    from localllm.kernels.quant.repack import PackedBlocks

    def one(p):
        return PackedBlocks(p.qtype, p.n, p.k, {f: t.clone() for f, t in p.planes.items()})

    return dataclasses.replace(pe, gate_up=tuple(one(p) for p in pe.gate_up), down=one(pe.down))


def _experts(types, seed):
    from localllm.kernels.moe.packed import pack_experts

    rng = np.random.default_rng(seed)
    fmt = ExpertFormat(*(QuantType(t) for t in types), D, H)
    parts = [
        np.stack([random_rows(types[0], H, D, rng) for _ in range(E)]),
        np.stack([random_rows(types[1], H, D, rng) for _ in range(E)]),
        np.stack([random_rows(types[2], D, H, rng) for _ in range(E)]),
    ]
    return pack_experts(*(torch.from_numpy(a).to(DEVICE) for a in parts), fmt, K_USED), fmt


def _mapped(pe, slots, every=1):
    from localllm.offload.mapped_experts import MappedExperts

    mapper = {} if CUDA else {"mapper": _clone_mapper}
    return MappedExperts(pe, slots, every=every, **mapper)


@pytest.mark.parametrize(
    "types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0, QT.Q8_0), (QT.Q4_K, QT.Q8_0, QT.Q6_K)]
)
def test_table_reads_equal_resident_bits_whatever_is_cached(types):
    from localllm.kernels.moe.packed import expert_ffn_packed

    pe, fmt = _experts(types, seed=1)
    m = _mapped(pe, slots=3)
    m.stats = ExpertStats()
    gen = torch.Generator().manual_seed(0)
    bias = torch.zeros(E)
    bias[[1, 6]] = 4.0  # two hot experts, the rest by chance
    routed = 0
    for step in range(6):
        x = torch.randn(2, D, generator=gen).to(DEVICE)
        w, ids = route_topk(torch.randn(2, E, generator=gen) + bias, K_USED, True)
        w, ids = w.to(DEVICE), ids.to(DEVICE)
        want = expert_ffn_packed(x, w, ids, pe, fmt)
        got = expert_ffn_packed(x, w, ids, m.packed, fmt)
        assert torch.equal(got, want), (step, m.slot_expert)
        m.count(ids)
        routed += ids.numel()
        m.tick()  # every=1: account and re-rank after each step
    assert {1, 6} <= set(m.slot_expert) and m.moved >= 2
    assert m.stats.lookups == routed and m.stats.hits + m.stats.misses == routed
    assert m.stats.hits > 0
    # the tables point cached experts at their slots and the rest at the host copy
    for w, pool, tab in zip((*m.host.gate_up, m.host.down), m._pool, m._tabs, strict=True):
        for slot, e in enumerate(m.slot_expert):
            if e < 0:  # (a slot no routed expert needed yet)
                continue
            for j, f in enumerate(w.planes):
                assert int(tab[e, j]) == pool[f][slot].data_ptr()
        cold = next(e for e in range(E) if e not in m.slot_expert)
        plane = next(iter(w.planes.values()))
        assert int(tab[cold, 0]) == plane[cold].data_ptr()


def test_kernels_read_a_cached_expert_from_its_slot():
    """Zeroing a slot changes exactly the pairs routed to the expert it holds: the table is
    what the kernels follow (a launch ignoring it would still read the host copy)."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    pe, fmt = _experts((QT.Q4_K, QT.Q4_K, QT.Q6_K), seed=2)
    m = _mapped(pe, slots=2)
    hot = torch.tensor([[3, 5]], device=DEVICE)
    m.count(hot)
    assert m.rebalance() == 2 and sorted(m.slot_expert) == [3, 5]
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    w = torch.full((2, K_USED), 0.5, device=DEVICE)
    ids = torch.tensor([[3, 0], [1, 2]], device=DEVICE)
    want = expert_ffn_packed(x, w, ids, pe, fmt)
    assert torch.equal(expert_ffn_packed(x, w, ids, m.packed, fmt), want)
    slot = m.slot_expert.index(3)
    for pool in m._pool:
        for t in pool.values():
            t[slot].zero_()
    got = expert_ffn_packed(x, w, ids, m.packed, fmt)
    assert not torch.equal(got[0], want[0])  # token 0 uses expert 3
    assert torch.equal(got[1], want[1])  # token 1 does not


def test_no_slots_reads_the_host_copy_and_still_accounts():
    from localllm.kernels.moe.packed import expert_ffn_packed

    pe, fmt = _experts((QT.Q8_0, QT.Q8_0, QT.Q8_0), seed=3)
    m = _mapped(pe, slots=0, every=2)
    m.stats = ExpertStats()
    assert all(p.table is None for p in (*m.packed.gate_up, m.packed.down))
    x = torch.randn(1, D).to(DEVICE)
    w, ids = route_topk(torch.randn(1, E), K_USED, True)
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    assert torch.equal(expert_ffn_packed(x, w, ids, m.packed, fmt),
                       expert_ffn_packed(x, w, ids, pe, fmt))  # fmt: skip
    for _ in range(2):
        m.count(ids)
        m.tick()
    assert (m.stats.lookups, m.stats.hits, m.stats.misses) == (4, 0, 4)
