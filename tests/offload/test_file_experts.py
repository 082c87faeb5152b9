"""Experts read from the file at the GPU's request into device slots (`offload.file_experts`,
`kernels.moe.slot_requests`, `offload/expert_reads.c`): decode steps give the resident packed
kernels' bits through misses, hits and evictions; each slot holds exactly its expert's planes
as `pack_experts` lays them out; a step with more pairs than slots is served in groups of rows;
a prompt reads its experts once and gives the resident bits; lookups, misses and bytes reach the
stats; a read that fails raises on the next call and empties the slots, after which the layer
reads again.

Runs on CUDA (marked `gpu`: mapped mailbox and staging, the request kernel spinning on the bus)
or on CPU tensors under TRITON_INTERPRET=1 (the reader thread answers plain memory).
"""

import os

import pytest
import torch

from localllm.kernels.moe import ExpertFormat, route_topk
from localllm.kernels.quant import QuantType
from localllm.offload.expert_reads import load_library
from tests.offload.tiny_moe import expert_layers_file
from tests.triton_env import CUDA, TRITON_MARKS
from tests.triton_env import DEVICE as DEVICE_NAME

DEVICE = torch.device(DEVICE_NAME)
LIB = load_library()
pytestmark = [*TRITON_MARKS, pytest.mark.skipif(LIB is None, reason="no C compiler")]
E, K_USED = 6, 2
FMT = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, 256, 256)


def _setup(tmp_path, slots, cap=None, seed=0, fmt=FMT, in_place=False):
    from localllm.kernels.moe.packed import pack_experts
    from localllm.offload.file_experts import FileExperts, FileSlots

    raws, layouts = expert_layers_file(tmp_path / "experts.bin", seed, fmt=fmt, n_expert=E)
    mapper = {} if CUDA else {"mapper": lambda t: t}
    shared = FileSlots(layouts, cap or 2 * K_USED, DEVICE, LIB, threads=2, in_place=in_place,
                       **mapper)  # fmt: skip
    layers = {i: FileExperts(i, layouts[i], fmt, slots, K_USED, shared) for i in layouts}
    resident = {i: pack_experts(*(t.to(DEVICE) for t in raws[i]), fmt, K_USED) for i in raws}
    return shared, layers, resident, layouts


def _route(gen, t, hot=None):
    logits = torch.randn(t, E, generator=gen)
    if hot is not None:
        logits[:, hot] += 4.0  # one hot expert: hits happen, the rest evict each other
    w, ids = route_topk(logits, K_USED, True)
    return w.to(DEVICE), ids.to(DEVICE)


def _by_rows(x, w, ids, pe, rows):
    """The resident launch per group of `rows` rows (a GPU's split of one launch over all rows
    may sum in another order: not the same bits)."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    t = ids.shape[0]
    parts = [expert_ffn_packed(x[i : i + rows], w[i : i + rows], ids[i : i + rows], pe, FMT)
             for i in range(0, t, rows)]  # fmt: skip
    return torch.cat(parts)


@pytest.mark.parametrize("in_place", [False, True])
def test_decode_steps_give_the_resident_bits_and_slots_hold_their_experts(tmp_path, in_place):
    """`in_place` (unified memory): misses are packed straight from the staging rows."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    shared, layers, resident, _ = _setup(tmp_path, slots=3, in_place=in_place)
    assert (shared.scratch is shared.reader.staging) == in_place
    try:
        gen = torch.Generator().manual_seed(0)
        routed = 0
        for step in range(10):
            for i, layer in layers.items():
                x = torch.randn(1, FMT.dim, generator=gen).to(DEVICE)
                w, ids = _route(gen, 1, hot=5)
                want = expert_ffn_packed(x, w, ids, resident[i], FMT)
                assert torch.equal(layer.ffn(x, w, ids, FMT), want), (step, i)
                routed += ids.numel()
        for i, layer in layers.items():
            layer.account()
            pe = resident[i]
            for slot, e in enumerate(layer.lru.expert_of.tolist()):
                for mine, theirs in zip((*layer.pool.pe.gate_up, layer.pool.pe.down),
                                        (*pe.gate_up, pe.down), strict=True):  # fmt: skip
                    for f, plane in theirs.planes.items():
                        assert torch.equal(mine.planes[f][slot], plane[e]), (i, slot, e, f)
        s = shared.stats
        assert s.lookups == routed and s.hits + s.misses == routed
        assert s.hits > 0 and s.misses >= 2 * 3  # every layer filled its slots, then evicted
        assert s.bytes_read == s.misses * layers[0].pool.expert_nbytes and s.read_seconds > 0
    finally:
        shared.close()


def test_more_pairs_than_slots_are_served_in_groups_of_rows(tmp_path):

    shared, layers, resident, _ = _setup(tmp_path, slots=2, cap=4)  # one token's pairs per request
    try:
        gen = torch.Generator().manual_seed(1)
        r = layers[1].rows
        assert r == 1
        for t in (1, 3, 5):
            x = torch.randn(t, FMT.dim, generator=gen).to(DEVICE)
            w, ids = _route(gen, t)
            want = _by_rows(x, w, ids, resident[1], r)
            assert torch.equal(layers[1].ffn(x, w, ids, FMT), want), t
    finally:
        shared.close()


@pytest.mark.parametrize("copy", [True, False])
def test_a_prompt_gives_the_resident_bits_with_or_without_room_for_its_copy(tmp_path, copy):
    """With room, a prompt reads each expert it routes to once and runs the resident launch
    (decode's slots untouched); without, it goes through the slots a few rows at a time (the
    resident launch per group of rows)."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    shared, layers, resident, _ = _setup(tmp_path, slots=4)
    shared.prompt_copy = copy
    try:
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(12, FMT.dim, generator=gen).to(DEVICE)
        w, ids = _route(gen, 12)
        if copy:
            want = expert_ffn_packed(x, w, ids, resident[0], FMT)
        else:
            want = _by_rows(x, w, ids, resident[0], layers[0].rows)
        assert torch.equal(layers[0].ffn(x, w, ids, FMT), want)
        cached = layers[0].lru.expert_of.tolist()
        if copy:
            used = torch.unique(ids).numel()
            assert shared.stats.bytes_read == used * layers[0].pool.expert_nbytes
            assert cached == [-1] * 4
        else:
            assert cached != [-1] * 4  # the slots served it
    finally:
        shared.close()


def test_a_failed_read_raises_empties_the_slots_and_the_layer_reads_again(tmp_path):
    from localllm.kernels.moe.packed import expert_ffn_packed

    shared, layers, resident, layouts = _setup(tmp_path, slots=4)
    try:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(1, FMT.dim, generator=gen).to(DEVICE)
        w = torch.full((1, K_USED), 0.5, device=DEVICE)
        layers[1].ffn(x, w, torch.tensor([[0, 1]], device=DEVICE), FMT)
        if CUDA:  # (the GPU asks for those reads later: they must be done before the shrink)
            torch.cuda.synchronize()
        path = layouts[1].ranges[0].path
        size = os.path.getsize(path)
        with open(path, "r+b") as f:  # the file shrinks under the reader: layer 1's last
            f.truncate(layouts[1].ranges[2].offset)  # experts' down rows are gone
        layers[1].ffn(x, w, torch.tensor([[2, 3]], device=DEVICE), FMT)  # the GPU goes on
        if CUDA:
            torch.cuda.synchronize()
        with pytest.raises(OSError, match="reading experts failed"):
            layers[0].ffn(x, w, torch.tensor([[0, 1]], device=DEVICE), FMT)
        assert all(layer.lru.expert_of.tolist() == [-1] * 4 for layer in layers.values())
        expert_layers_file(tmp_path / "experts.bin", 0, fmt=FMT, n_expert=E)
        assert os.path.getsize(path) == size  # the same bytes are back
        ids = torch.tensor([[2, 3]], device=DEVICE)
        want = expert_ffn_packed(x, w, ids, resident[1], FMT)
        assert torch.equal(layers[1].ffn(x, w, ids, FMT), want)
    finally:
        shared.close()


def test_reads_ahead_fill_the_next_layers_slots_and_keep_the_resident_bits(tmp_path):
    """Layer 0's step reads layer 1's guessed experts without waiting; layer 1 packs them first:
    a right guess leaves layer 1 no miss of its own, a wrong one costs slots but never bits."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    shared, layers, resident, _ = _setup(tmp_path, slots=4)
    layers[0].ahead = layers[1]
    try:
        gen = torch.Generator().manual_seed(5)
        for step in range(6):
            x0, x1 = (torch.randn(1, FMT.dim, generator=gen).to(DEVICE) for _ in range(2))
            (w0, ids0), (w1, ids1) = _route(gen, 1), _route(gen, 1)
            right = step % 2 == 0
            guess = ids1 if right else (ids1 + 1) % E
            got = layers[0].ffn(x0, w0, ids0, FMT, guess=guess)
            assert torch.equal(got, expert_ffn_packed(x0, w0, ids0, resident[0], FMT)), step
            missed = int(layers[1].lru.counters[2])
            got = layers[1].ffn(x1, w1, ids1, FMT)
            assert torch.equal(got, expert_ffn_packed(x1, w1, ids1, resident[1], FMT)), step
            if right:
                assert int(layers[1].lru.counters[2]) == missed, step  # every pair a hit
        for layer in layers.values():
            layer.account()
        assert shared.stats.prefetched > 0
        assert shared.stats.lookups == 6 * 2 * K_USED  # guesses are not lookups
    finally:
        shared.close()


def test_a_read_ahead_whose_rows_were_reused_is_dropped(tmp_path):
    """Another request between a read-ahead and its layer reuses the staging rows: the guessed
    slots are emptied instead of packed from them, and the layer reads its experts itself."""
    from localllm.kernels.moe.packed import expert_ffn_packed

    shared, layers, resident, _ = _setup(tmp_path, slots=4)
    layers[0].ahead = layers[1]
    try:
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(1, FMT.dim, generator=gen).to(DEVICE)
        w = torch.full((1, K_USED), 0.5, device=DEVICE)
        ids1 = torch.tensor([[4, 5]], device=DEVICE)
        layers[0].ffn(x, w, torch.tensor([[0, 1]], device=DEVICE), FMT, guess=ids1)
        layers[0].ffn(x, w, torch.tensor([[2, 3]], device=DEVICE), FMT)  # misses: a request
        got = layers[1].ffn(x, w, ids1, FMT)
        assert torch.equal(got, expert_ffn_packed(x, w, ids1, resident[1], FMT))
        layers[1].account()  # (layer 1's counts alone)
        assert (shared.stats.hits, shared.stats.misses) == (0, K_USED)  # read both itself
    finally:
        shared.close()
