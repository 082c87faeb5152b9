"""Streamed experts whose misses the CPU computes (`engine.moe_hybrid`), on CPU tensors: the pairs a
slot holds go to the "GPU" part with their slot and weight (misses weigh 0), the others to the
native kernels over the file's blocks; the sum is those two parts' sum and equals the dense
oracle; misses earn reads into slots at a bounded rate, most used first (the GPU test is in
test_gpu_residency.py)."""

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.moe_hybrid import HYBRID_MAX_T, HybridExperts
from localllm.kernels.cpu import native
from localllm.kernels.cpu.rows_call import RowsCall
from localllm.kernels.moe import ExpertFormat, expert_ffn_reference
from localllm.kernels.quant import QuantType
from localllm.offload import expert_cache
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_source import ExpertLayout
from localllm.offload.ranges import ByteRange
from tests.perf.make_synthetic import random_rows

TYPES = (QT.Q4_K, QT.Q4_K, QT.Q6_K)  # Qwen3-30B-A3B Q4_K_M's mix
E, DIM, HID, K = 12, 256, 512, 4
QTS = tuple(QuantType(t) for t in TYPES)
FMT = ExpertFormat(*QTS, DIM, HID, "silu")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    k = native.load(tmp_path_factory.mktemp("native"))
    if k is None:
        pytest.skip("no C compiler here")
    return k


@pytest.fixture
def layer(tmp_path):
    """One layer's three expert tensors, written to a file: (tensors, {0: layout})."""
    rng = np.random.default_rng(7)
    shapes = ((HID, DIM), (HID, DIM), (DIM, HID))
    tensors = tuple(
        torch.from_numpy(np.stack([random_rows(TYPES[i], r, c, rng) for _ in range(E)]))
        for i, (r, c) in enumerate(shapes)
    )
    path, pos, ranges = tmp_path / "experts.bin", 32, []
    with path.open("wb") as f:
        f.write(bytes(pos))
        for t in tensors:
            f.write(t.numpy().tobytes())
            ranges.append(ByteRange(str(path), pos, t.numel()))
            pos += t.numel()
    shapes = tuple(tuple(t.shape[1:]) for t in tensors)
    return tensors, {0: ExpertLayout(E, tuple(ranges), shapes, FMT)}


def test_run_pairs_gives_each_row_its_pairs_sum(kernels, layer):
    """Rows with different pair counts (none included): each row's bits are moe_ffn's over that
    row's pairs alone; bad pairs are refused before any kernel runs."""
    (g, u, d), _ = layer
    call = RowsCall(kernels, (g, u, d), QTS, "silu", max_rows=4, k=3)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, DIM, generator=gen)
    pairs = [(0, 5, 0.25), (2, 1, 0.5), (0, 11, 0.75), (2, 5, 0.125), (2, 0, 1.0)]
    y = torch.full((3, DIM), float("nan"))
    call.run_pairs(3, x.data_ptr(), pairs, y.data_ptr(), 2)
    for row in range(3):
        mine = [(e, w) for r, e, w in pairs if r == row]
        if not mine:
            assert torch.equal(y[row], torch.zeros(DIM))
            continue
        ids = torch.tensor([[e for e, _ in mine]])
        w = torch.tensor([[w for _, w in mine]])
        want = kernels.moe_ffn(x[row : row + 1], w, ids, g, u, d, QTS, "silu")
        assert torch.equal(y[row : row + 1], want)
    for bad in ([], [(3, 0, 1.0)], [(0, E, 1.0)], [(0, 1, 1.0)] * 4):
        with pytest.raises(ValueError, match="bad pairs"):
            call.run_pairs(3, x.data_ptr(), bad, y.data_ptr(), 2)


def _slot_part(kernels, source: StreamedExperts, layout):
    """The "GPU" part over the source's slots (their raw bytes, as the packed pool holds them
    packed), recording what it was given."""
    blocks = [source._blocks(s, layout) for s in range(source.n_slots)]
    g, u, d = (torch.stack([getattr(b, n) for b in blocks]) for n in ("gate", "up", "down"))
    seen = []

    def gpu(x, xq, w, slots):
        y = kernels.moe_ffn(x, w, slots, g, u, d, QTS, "silu")
        seen.append((w.clone(), slots.clone(), y.clone()))
        return y

    return gpu, seen


@pytest.mark.parametrize("tokens", [1, 3, HYBRID_MAX_T])
def test_hits_run_on_slots_and_misses_on_the_cpu(kernels, layer, tokens):
    (g, u, d), layouts = layer
    source = StreamedExperts(layouts, slots=4)
    held = [2, 7, 9]
    source.slots_for(0, held)  # the slots hold these three (and one is free)
    hybrid = HybridExperts(kernels, (g, u, d), QTS, "silu", DIM, K, source, 0, torch.device("cpu"))
    gpu, seen = _slot_part(kernels, source, layouts[0])
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, DIM, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    ids[0, :3] = torch.tensor(held)  # the first token hits three slots and misses one
    w = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    before = source.stats.snapshot()
    y = hybrid.ffn(x, None, w, ids, gpu)
    source.drain()  # the admission thread's reads have landed
    st = source.stats.snapshot()

    ((gw, gs, yg),) = seen
    hit = torch.tensor([[e in held for e in row] for row in ids.tolist()])
    assert torch.equal(gw, torch.where(hit, w, torch.zeros_like(w)))  # misses weigh exactly 0
    slot_of = {e: s for e, s in zip(held, source.held(0, held), strict=True)}
    assert all(gs[i, j] == slot_of[e] for (i, j), e in np.ndenumerate(ids.numpy()) if hit[i, j])
    # the sum of the two parts: the slots' (hits) and the file's (misses, per row, in order)
    cpu = torch.zeros(tokens, DIM)
    for i in range(tokens):
        miss = [j for j in range(K) if not hit[i, j]]
        if miss:
            cpu[i] = kernels.moe_ffn(x[i : i + 1], w[i : i + 1, miss], ids[i : i + 1, miss],
                                     g, u, d, QTS, "silu")[0]  # fmt: skip
    assert torch.equal(y, yg + cpu)
    want = expert_ffn_reference(x, w, ids, g, u, d, FMT)  # the dense oracle over all k
    rel = ((y.double() - want.double()).norm() / want.double().norm()).item()
    assert want.abs().max() > 1e-3 and rel < 2e-2
    n_used, n_miss = len(set(ids.reshape(-1).tolist())), int((~hit).sum())
    assert st.lookups - before.lookups == n_used
    assert st.misses - before.misses == len(set(ids.reshape(-1).tolist()) - set(held))
    assert st.cpu_pairs == n_miss and st.cpu_seconds > 0
    # the misses earned reads, into the one free slot (the others hold experts of the step
    # itself, which stay)
    reads = min(int((st.misses - before.misses) * expert_cache.ADMIT_SHARE), 1)
    assert st.bytes_read - before.bytes_read == reads * layouts[0].expert_nbytes


def test_admission_reads_the_most_used_into_less_used_slots(kernels, layer, monkeypatch):
    """Each miss earns ADMIT_SHARE of a read; free slots first, then (lfu) only in place of a
    less used expert; the slot then holds the expert's bytes from the file."""
    monkeypatch.setattr(expert_cache, "ADMIT_SHARE", 0.5)
    (g, u, d), layouts = layer
    source = StreamedExperts(layouts, slots=2, evict="lfu")
    assert source.held(0, [0, 1]) == [None, None]
    assert source.admit(0, [0, 1]) == 1  # 2 misses x 0.5: one read, into a free slot
    source.drain()  # (reads land on the admission thread; `held` settles the finished ones)
    assert source.held(0, [3, 4]) == [None, None]
    assert source.admit(0, [3, 4]) == 1  # the other free slot (equal uses: the first)
    source.drain()
    assert source.held(0, [3, 4])[1] is None
    assert source.admit(0, [4]) == 0  # half a read earned: none yet
    # expert 4 (3 uses) replaces the least used expert outside the step's own: 0 (1 use), not 3
    # (2 uses)
    assert source.held(0, [4]) == [None]
    assert source.admit(0, [4]) == 1
    source.drain()
    held = dict(zip([0, 3, 4], source.held(0, [0, 3, 4]), strict=True))
    assert held[0] is None and held[3] is not None and held[4] is not None
    b = source._blocks(held[4], layouts[0])
    assert torch.equal(b.gate, g[4]) and torch.equal(b.up, u[4]) and torch.equal(b.down, d[4])
    # an expert used less than every held one is never read in, whatever the credit
    assert source.held(0, [5]) == [None]
    source._credit = 4.0
    assert source.admit(0, [5]) == 0
    source.drain()
    assert source.stats.bytes_read == 3 * layouts[0].expert_nbytes


def test_admissions_in_flight_are_bounded_and_miss_until_they_land(layer, monkeypatch):
    """At most ADMIT_IN_FLIGHT reads are on their way; an expert being read is a miss (never
    waited for) until its read has landed, then a hit."""
    monkeypatch.setattr(expert_cache, "ADMIT_SHARE", 1.0)
    monkeypatch.setattr(expert_cache, "ADMIT_IN_FLIGHT", 2)
    _, layouts = layer
    source = StreamedExperts(layouts, slots=6)
    gate = threading.Event()
    real = source._read_many

    def slow(layout, misses):
        gate.wait(10)
        return real(layout, misses)

    source._read_many = slow
    assert source.held(0, [0, 1, 2, 3]) == [None] * 4
    assert source.admit(0, [0, 1, 2, 3]) == 2  # four earned, two at once
    assert source.held(0, [0, 1]) == [None, None]  # on their way: misses, nothing waited for
    assert source.admit(0, [0, 1, 2]) == 0  # (0 and 1 in flight; no room for 2)
    gate.set()
    source.drain()
    assert None not in source.held(0, [0, 1])
    assert source.stats.stall_seconds < 10 and source.stats.bytes_read > 0


def test_a_failed_admission_read_leaves_a_miss_and_a_free_slot(layer, monkeypatch, caplog):
    monkeypatch.setattr(expert_cache, "ADMIT_SHARE", 1.0)
    _, layouts = layer
    source = StreamedExperts(layouts, slots=1)

    def broken(layout, misses):
        raise OSError(5, "Input/output error")

    real, source._read_many = source._read_many, broken
    assert source.held(0, [3]) == [None]
    assert source.admit(0, [3]) == 1
    source.drain()  # the failure is logged, not raised into the decode step
    assert "expert read of layer 0 expert 3 failed" in caplog.text
    assert source.held(0, [3]) == [None] and source._free == [0]
    source._read_many = real  # the next admission takes the freed slot
    assert source.admit(0, [3]) == 1
    source.drain()
    assert source.held(0, [3]) == [0]


def test_lru_admission_takes_the_least_recent_slot(layer):
    """evict = lru: every miss is read in (ADMIT_SHARE 1), into the least recently used slot
    outside the step's own experts, whatever the uses."""
    _, layouts = layer
    source = StreamedExperts(layouts, slots=2)
    for e in (0, 1):
        assert source.held(0, [e]) == [None] and source.admit(0, [e]) == 1
        source.drain()
    for _ in range(3):
        assert None not in source.held(0, [0, 1])  # both held, 1 the more recent
    assert source.held(0, [1, 5]) == [source.held(0, [1])[0], None]
    assert source.admit(0, [5]) == 1  # replaces 0 (least recent, used more than 5)
    source.drain()
    assert source.held(0, [0]) == [None] and None not in source.held(0, [1, 5])
