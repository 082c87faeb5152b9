"""Mapped host experts with a device-side LRU of slots (`offload.mapped_experts`,
`kernels.moe.slot_lru`): the assign kernel makes the plain-torch oracle's decisions; the grouped
GEMVs over the slots give the bits of the resident launch whatever is cached or evicted; a
cached expert really is read from its slot; lookups and misses reach the stats.

Runs on CUDA (marked `gpu`, with real mapped host memory) or on CPU tensors under
TRITON_INTERPRET=1 (the "host copy" is then a plain clone).
"""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.moe import ExpertFormat, route_topk
from localllm.kernels.quant import QuantType
from localllm.offload.expert_stats import ExpertStats
from tests.perf.make_synthetic import random_rows
from tests.triton_env import CUDA, TRITON_MARKS
from tests.triton_env import DEVICE as DEVICE_NAME

DEVICE = torch.device(DEVICE_NAME)
pytestmark = TRITON_MARKS
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


def _mapped(pe, slots):
    from localllm.offload.mapped_experts import MappedExperts

    mapper = {} if CUDA else {"mapper": _clone_mapper}
    return MappedExperts(pe, slots, K_USED, **mapper)


@pytest.mark.parametrize("slots", [2, 5, 8])
def test_assign_makes_the_reference_decisions(slots):
    from localllm.kernels.moe.slot_lru import LruState, assign, assign_reference

    st = LruState.empty(E, slots, DEVICE)
    ref = LruState.empty(E, slots, "cpu")
    jobs = torch.zeros(2 * E, dtype=torch.int32, device=DEVICE)
    njobs = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(slots)
    for step in range(12):
        tokens = 1 if slots < 4 else 2
        ids = torch.stack([torch.randperm(E, generator=gen)[:K_USED] for _ in range(tokens)])
        if step % 3 == 2:
            ids[:, 0] = 0  # a repeat: expert 0 stays hot
        got = assign(ids.to(DEVICE), st, jobs, njobs)
        want, want_jobs = assign_reference(ids, ref)
        assert torch.equal(got.cpu(), want), step
        n = int(njobs)
        assert [tuple(j) for j in jobs.view(-1, 2)[:n].tolist()] == want_jobs
        for a, b in zip(dataclasses.astuple(st), dataclasses.astuple(ref), strict=True):
            assert torch.equal(a.cpu(), b), step
    assert 0 < int(ref.counters[2]) < int(ref.counters[1])  # some hits, some misses


@pytest.mark.parametrize(
    "types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0, QT.Q8_0), (QT.Q4_K, QT.Q8_0, QT.Q6_K)]
)
def test_slot_reads_equal_resident_bits_whatever_is_cached(types):
    from localllm.kernels.moe.packed import expert_ffn_packed

    pe, fmt = _experts(types, seed=1)
    m = _mapped(pe, slots=3)
    m.stats = ExpertStats()
    gen = torch.Generator().manual_seed(0)
    bias = torch.zeros(E)
    bias[6] = 4.0  # one hot expert, the rest by chance: hits and evictions both happen
    routed = 0
    for step in range(8):
        x = torch.randn(1, D, generator=gen).to(DEVICE)
        w, ids = route_topk(torch.randn(1, E, generator=gen) + bias, K_USED, True)
        w, ids = w.to(DEVICE), ids.to(DEVICE)
        want = expert_ffn_packed(x, w, ids, pe, fmt)
        assert torch.equal(m.ffn(x, w, ids, fmt), want), step
        routed += ids.numel()
    m.account()
    s = m.stats
    assert s.lookups == routed and s.hits + s.misses == routed and s.hits > 0 and s.misses >= 3
    assert 6 in m.lru.expert_of.tolist()
    for slot, e in enumerate(m.lru.expert_of.tolist()):  # each slot holds its expert's planes
        for mine, theirs in zip(
            (*m.pool.gate_up, m.pool.down), (*pe.gate_up, pe.down), strict=True
        ):
            for f, plane in theirs.planes.items():
                assert torch.equal(mine.planes[f][slot], plane[e]), (slot, e, f)


def test_kernels_read_a_cached_expert_from_its_slot():
    """Zeroing the slot of a cached expert changes exactly the pairs routed to it next time: the
    GEMVs read the slots (a path reading the host copy would not notice)."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    pe, fmt = _experts((QT.Q4_K, QT.Q4_K, QT.Q6_K), seed=2)
    m = _mapped(pe, slots=4)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    w = torch.full((2, K_USED), 0.5, device=DEVICE)
    ids = torch.tensor([[3, 0], [1, 2]], device=DEVICE)
    want = expert_ffn_packed(x, w, ids, pe, fmt)
    assert torch.equal(m.ffn(x, w, ids, fmt), want)  # misses: copied in, then read
    slot = m.lru.expert_of.tolist().index(3)
    for p in (*m.pool.gate_up, m.pool.down):
        for t in p.planes.values():
            t[slot].zero_()
    got = m.ffn(x, w, ids, fmt)  # all hits now
    assert not torch.equal(got[0], want[0])  # token 0 uses expert 3
    assert torch.equal(got[1], want[1])  # token 1 does not


def test_no_slots_or_too_many_pairs_read_the_host_copy_and_count():
    from localllm.kernels.moe.packed import expert_ffn_packed

    pe, fmt = _experts((QT.Q8_0, QT.Q8_0, QT.Q8_0), seed=3)
    for slots in (0, 3):  # 3 slots, 4 pairs: the host copy for this call
        m = _mapped(pe, slots)
        m.stats = ExpertStats()
        x = torch.randn(2, D).to(DEVICE)
        w, ids = route_topk(torch.randn(2, E), K_USED, True)
        w, ids = w.to(DEVICE), ids.to(DEVICE)
        assert torch.equal(m.ffn(x, w, ids, fmt), expert_ffn_packed(x, w, ids, pe, fmt))
        m.replayed(1)  # a graph replay of one token
        m.account()
        replay = K_USED if slots == 0 else 0  # (a cache counts replays on the device)
        want = 4 + replay
        assert (m.stats.lookups, m.stats.hits, m.stats.misses) == (want, 0, want)


def test_a_prompt_copies_the_layer_once_and_gives_the_in_place_bits(monkeypatch):
    """prompt_copy: a prompt routing at least as many pairs as experts runs on a device copy of
    the layer (one copy per plane), with the bits of reading the host copy in place; a short
    call and a layer mapped without the copy read in place."""
    from localllm.offload import mapped_experts

    pe, fmt = _experts((QT.Q4_K, QT.Q4_K, QT.Q6_K), seed=4)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, D, generator=gen).to(DEVICE)
    w, ids = route_topk(torch.randn(12, E, generator=gen), K_USED, True)
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    copies = []
    real = mapped_experts.host_view
    monkeypatch.setattr(mapped_experts, "host_view", lambda t: copies.append(t) or real(t))
    plain = _mapped(pe, 0)
    in_place = plain.ffn(x, w, ids, fmt)
    assert not copies
    mapper = {} if CUDA else {"mapper": _clone_mapper}
    copying = mapped_experts.MappedExperts(pe, 0, K_USED, prompt_copy=True, **mapper)
    assert torch.equal(copying.ffn(x, w, ids, fmt), in_place)
    planes = [t for p in (*copying.host.gate_up, copying.host.down) for t in p.planes.values()]
    assert len(copies) == len(planes) and all(a is b for a, b in zip(copies, planes, strict=True))
    copies.clear()
    copying.ffn(x[:2], w[:2], ids[:2], fmt)  # decode-sized: read in place
    assert not copies
