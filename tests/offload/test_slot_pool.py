"""Streamed experts kept packed in a device slot pool: the grouped GEMVs over slot numbers give
the bits of the resident packed layer, whatever was evicted or read ahead; counters stay exact;
a tiny qwen3moe decodes token- and bit-identically resident vs streamed into few slots.

Kernel tests run on CUDA (marked `gpu`) or on CPU tensors under TRITON_INTERPRET=1; the model
test runs under the interpreter (on a GPU the engine path is `test_gpu_residency.py`'s).
"""

import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.sampling.params import SamplingParams
from localllm.kernels.fused import WeightedRows
from localllm.kernels.moe import ExpertFormat, route_topk
from localllm.kernels.quant import QuantType
from localllm.offload.expert_cache import STAGE_WAVE, StreamedExperts
from localllm.offload.expert_source import ResidentExperts
from tests.offload.tiny_moe import QWEN3MOE, expert_layers_file, write_moe_gguf
from tests.perf.make_synthetic import random_rows
from tests.triton_env import DEVICE as DEVICE_NAME
from tests.triton_env import INTERPRET, needs_triton

DEVICE = torch.device(DEVICE_NAME)
E, K_USED, D, H = 6, 2, 256, 256
FMT = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, D, H)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("slots", "prefetch"), [(2, False), (3, False), (3, True), (6, False)])
def test_grouped_ffn_over_slots_equals_resident_bit_for_bit(tmp_path, slots, prefetch):
    from localllm.kernels.moe.packed import expert_ffn_packed, pack_experts
    from localllm.kernels.quant.repack import expert_planes

    raws, layouts = expert_layers_file(tmp_path / "experts.bin", seed=slots)
    resident = {
        layer: pack_experts(*(t.to(DEVICE) for t in raw), FMT, K_USED)
        for layer, raw in raws.items()
    }
    src = StreamedExperts(layouts, slots, prefetch=prefetch, pack_on=DEVICE, n_used=K_USED)
    pool = src.packed_pool
    assert pool.n_slots == slots and pool.pe.n_expert == slots
    # host memory: a ring of staging buffers (one per slot and one for the prefetch thread,
    # up to twice the experts read at once), never a raw copy of every slot
    assert src.pool.shape[0] == min(2 * STAGE_WAVE, slots + 1)
    gen = torch.Generator().manual_seed(slots)
    for _ in range(4):
        for layer in (0, 1):
            tokens = 1 if slots < 4 else 2
            x = torch.randn(tokens, D, generator=gen).to(DEVICE)
            w, ids = route_topk(torch.randn(tokens, E, generator=gen), K_USED, True)
            src.routed(layer, ids)
            experts = sorted(set(ids.reshape(-1).tolist()))
            slot = dict(zip(experts, src.slots_for(layer, experts), strict=True))
            sid = torch.tensor([[slot[e] for e in row] for row in ids.tolist()])
            w, ids, sid = w.to(DEVICE), ids.to(DEVICE), sid.to(DEVICE)
            want = expert_ffn_packed(x, w, ids, resident[layer], FMT)
            got = expert_ffn_packed(x, w, sid, pool.pe, FMT)
            assert torch.equal(got, want), (layer, experts, slot)
            for e, s in slot.items():  # the slot holds exactly that expert's packed planes
                mine, theirs = pool.view(s), resident[layer]
                parts = zip((*mine.gate_up, mine.down), (*theirs.gate_up, theirs.down), strict=True)
                for a, b in parts:
                    ref = expert_planes(b, e)
                    assert all(torch.equal(a.planes[k][0], ref.planes[k]) for k in ref.planes)
            if prefetch:  # guess the other layer's experts: reads land in the pool meanwhile
                src.guess(1 - layer, list(range(E))[:K_USED])
    src.close()
    s = src.stats
    assert s.lookups == s.hits + s.misses and s.misses > 0
    assert s.bytes_read == (s.misses + s.prefetched) * layouts[0].expert_nbytes


@pytest.mark.gpu
@needs_triton
def test_slot_pool_rejects_two_formats_and_too_many_experts(tmp_path):
    _, layouts = expert_layers_file(tmp_path / "experts.bin", seed=1)
    other = replace(FMT, act="gelu")  # same shapes, another format
    mixed = {0: layouts[0], 1: replace(layouts[1], fmt=other)}
    with pytest.raises(ValueError, match="one expert format"):
        StreamedExperts(mixed, 2, pack_on=DEVICE, n_used=K_USED)
    src = StreamedExperts(layouts, 2, pack_on=DEVICE, n_used=K_USED)
    with pytest.raises(ValueError, match="do not fit"):
        src.slots_for(0, [0, 1, 2])
    src.close()


def _one_expert(types, seed: int):
    """(format, its gate/up/down raw rows, the three back to back as one uint8 tensor)."""
    fmt = ExpertFormat(*(QuantType(t) for t in types), D, H)
    rng = np.random.default_rng(seed)
    parts = [random_rows(types[0], H, D, rng), random_rows(types[1], H, D, rng)]
    parts.append(random_rows(types[2], D, H, rng))
    return fmt, parts, torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]))


@pytest.mark.parametrize(
    "types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0, QT.Q8_0), (QT.Q4_K, QT.Q8_0, QT.Q6_K)]
)
def test_fill_raw_packs_the_planes_pack_experts_makes(types):
    """A slot filled from one expert's raw bytes back to back (one upload, fields written in
    place) holds exactly the planes `pack_experts` makes of that expert; the slot beside it is
    untouched. Pure torch: runs on CPU tensors wherever triton imports."""
    pytest.importorskip("triton")
    from localllm.kernels.moe.packed import pack_experts
    from localllm.kernels.moe.slot_pool import PackedSlotPool

    fmt, parts, raw = _one_expert(types, seed=3)
    want = pack_experts(*(torch.from_numpy(p)[None] for p in parts), fmt, K_USED)
    pool = PackedSlotPool(fmt, 3, K_USED, DEVICE)
    pool.fill_raw(1, raw.to(DEVICE))
    pairs = zip((*pool.pe.gate_up, pool.pe.down), (*want.gate_up, want.down), strict=True)
    for got, ref in pairs:
        assert got.planes.keys() == ref.planes.keys()
        for name, plane in got.planes.items():
            assert torch.equal(plane[1].cpu(), ref.planes[name][0]), name
            assert not plane[0].any() and not plane[2].any(), name
    with pytest.raises(ValueError, match="do not hold one expert"):
        pool.fill_raw(0, raw[:-1])


@pytest.mark.parametrize(
    "types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0, QT.Q8_0), (QT.Q4_K, QT.Q8_0, QT.Q6_K)]
)
def test_fill_mapped_writes_the_bytes_fill_raw_writes(types):
    """One gather per plane through the byte maps fills a slot with exactly `fill_raw`'s planes
    (the reference packing); the maps leave slot 0 zeroed and other slots are untouched."""
    pytest.importorskip("triton")
    from localllm.kernels.moe.slot_pool import PackedSlotPool

    fmt, _, raw = _one_expert(types, seed=4)
    ref, got = PackedSlotPool(fmt, 3, K_USED, DEVICE), PackedSlotPool(fmt, 3, K_USED, DEVICE)
    ref.fill_raw(2, raw.to(DEVICE))
    got.byte_maps()
    assert all(not t.any() for t in got.plane_bytes)
    got.fill_mapped(2, raw)  # from host memory, as staged reads come
    for a, b in zip(got.plane_bytes, ref.plane_bytes, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    with pytest.raises(ValueError, match="do not hold one expert"):
        got.fill_mapped(0, raw[:-1])
    # the maps exist before any fill: a first fill_mapped into slot 1 (another thread's) leaves
    # an expert already in slot 0 alone (made lazily, they were found by packing into slot 0)
    fresh = PackedSlotPool(fmt, 3, K_USED, DEVICE)
    fresh.fill_raw(0, raw.to(DEVICE))
    fresh.fill_mapped(1, raw)
    for a, b in zip(fresh.plane_bytes, ref.plane_bytes, strict=True):
        assert torch.equal(a[:1].cpu(), b[2:].cpu()) and torch.equal(a[1:2].cpu(), b[2:].cpu())


PROMPT = [1, 5, 9, 33, 7, 11]  # at most the pool's max_tokens: every step takes packed kernels
MODES = {"8 slots": (8, False), "3 slots": (3, False), "2 slots, read-ahead": (2, True)}


def _decode(path, mode: str | None):
    """Greedy tokens and every step's output of the last MoE block, resident packed experts or
    streamed into a packed slot pool (CPU tensors through the interpreted kernels)."""
    from localllm.kernels.moe.packed import pack_experts

    g = open_gguf(path)
    model = build_model(g)
    blocks = moe_blocks(model)
    if mode is None:
        for b in blocks:
            b.packed = pack_experts(*(w.data for w in b.expert_weights()), b.format, b.n_used)
        source = ResidentExperts({})
    else:
        slots, prefetch = MODES[mode]
        layouts = {}
        for b in blocks:
            layouts[b.layer] = b.stream_layout()
            for t in (b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps):
                t.release()
        n_used = blocks[0].n_used
        source = StreamedExperts(layouts, slots, prefetch, pack_on=DEVICE, n_used=n_used)
        if prefetch:
            for b, nxt in itertools.pairwise(blocks):
                b.guess_next = nxt
    for b in blocks:
        b.attach(source)
    outs = []
    # resident decode rows come back unsummed (the next norm's kernel sums them): their total
    blocks[-1].register_forward_hook(
        lambda m, a, out: outs.append(out.total() if isinstance(out, WeightedRows) else out.clone())
    )
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = list(gen.stream(PROMPT, params))
    if isinstance(source, StreamedExperts):
        source.close()
    return tokens, outs, source


@pytest.mark.skipif(not INTERPRET, reason="the interpreted kernels on CPU tensors")
def test_tiny_qwen3moe_identical_resident_vs_slot_pool(tmp_path):
    path = write_moe_gguf(tmp_path / "moe.gguf", replace(QWEN3MOE, expert_qtype=QT.Q8_0), seed=5)
    want_tokens, want_outs, _ = _decode(path, None)
    assert len(set(want_tokens)) > 3
    for mode in MODES:
        tokens, outs, src = _decode(path, mode)
        assert tokens == want_tokens, mode
        assert len(outs) == len(want_outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True)), mode
        s = src.stats
        assert s.misses > 0 and s.lookups == s.hits + s.misses, mode
        assert src.packed_pool.n_slots == MODES[mode][0]
