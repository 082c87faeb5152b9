"""The reader that answers a GPU's expert requests (`offload/expert_reads.c`): this test writes the
mailbox as the request kernel does and checks that the staged rows hold the file's bytes of each
expert asked for, in order; a request for an expert or layer the reader does not have, or
bytes past the file's end, answers with an error that `check` raises once, and the reader keeps
serving; a prompt's reads (`read_parts`) land in three part tensors; the thread stops on close.
Runs wherever a C compiler builds the reader (no GPU: plain memory stands for mapped memory)."""

import time

import numpy as np
import pytest
import torch

from localllm.offload.expert_reads import BOX_WORDS, ExpertReader, load_library
from localllm.offload.expert_source import ExpertLayout
from localllm.offload.ranges import ByteRange

LIB = load_library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler builds the reader")
E = 6
SHAPES = ((3, 1000), (3, 1000), (5, 600))


def _plain(tensors):
    return tensors


def _file(tmp_path, layers=(0, 3), seed=0, short=False):
    """Per layer E experts of SHAPES back to back in one file (after a 100-byte header)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 100 + len(layers) * E * sum(r * c for r, c in SHAPES), np.uint8)
    path = tmp_path / "experts.bin"
    path.write_bytes(data[: -1000 if short else None].tobytes())
    layouts, off = {}, 100
    for layer in layers:
        ranges = []
        for r, c in SHAPES:
            ranges.append(ByteRange(str(path), off, E * r * c))
            off += E * r * c
        layouts[layer] = ExpertLayout(E, tuple(ranges), SHAPES)
    return torch.from_numpy(data), layouts


def _expert(data, layout, e):
    return torch.cat([data[r.offset : r.offset + r.nbytes] for r in layout.expert_ranges(e)])


def _ask(reader, layer, experts, seq, count=None, timeout=10.0):
    """What the request kernel does: ids, layer, count, then the request number; waits."""
    box = reader.box_host
    box[BOX_WORDS : BOX_WORDS + len(experts)] = torch.tensor(experts, dtype=torch.int64)
    box[2], box[3] = layer, len(experts) if count is None else count
    box[0] = seq
    t0 = time.monotonic()
    while int(box[1]) != seq:
        assert time.monotonic() - t0 < timeout, "the reader did not answer"
        time.sleep(1e-4)


@pytest.mark.parametrize("threads", [1, 3])
def test_requests_are_answered_with_the_files_bytes(tmp_path, threads):
    data, layouts = _file(tmp_path)
    reader = ExpertReader(layouts, cap=4, lib=LIB, mapper=_plain, threads=threads)
    reader.start()
    try:
        for seq, (layer, experts) in enumerate([(3, [5, 0, 2]), (0, [1]), (3, [4, 3, 1, 0])], 1):
            _ask(reader, layer, experts, seq)
            reader.check()  # no error
            for i, e in enumerate(experts):
                want = _expert(data, layouts[layer], e)
                assert torch.equal(reader.staging_host[i, : want.numel()], want), (seq, i)
        requests, experts, nbytes, seconds = reader.stats()
        per = layouts[0].expert_nbytes
        assert (requests, experts, nbytes) == (3, 8, 8 * per) and seconds > 0
    finally:
        reader.close()


def test_bad_requests_raise_once_and_the_reader_goes_on(tmp_path):
    data, layouts = _file(tmp_path)
    reader = ExpertReader(layouts, cap=2, lib=LIB, mapper=_plain)
    reader.start()
    try:
        # an expert past the layer's, a layer it does not read, more experts than staging rows
        for seq, (layer, experts, count) in enumerate([(3, [E], 1), (1, [0], 1), (0, [0], 3)], 1):
            _ask(reader, layer, experts, seq, count)
            with pytest.raises(ValueError, match="does not have"):
                reader.check()
            reader.check()  # raised once, cleared
        _ask(reader, 0, [4], 4)
        reader.check()
        assert torch.equal(reader.staging_host[0, : layouts[0].expert_nbytes],
                           _expert(data, layouts[0], 4))  # fmt: skip
    finally:
        reader.close()


def test_a_file_that_ends_early_is_an_os_error(tmp_path):
    _, layouts = _file(tmp_path, short=True)
    reader = ExpertReader(layouts, cap=2, lib=LIB, mapper=_plain)
    reader.start()
    try:
        _ask(reader, 0, [0], 1)
        reader.check()  # the first layer's bytes are all there
        _ask(reader, 3, [E - 1], 2)
        with pytest.raises(OSError, match="reading experts failed"):
            reader.check()
        with pytest.raises(OSError):
            reader.read(3, [E - 1])  # the same on the calling thread
    finally:
        reader.close()


def test_read_parts_fills_three_part_tensors(tmp_path):
    data, layouts = _file(tmp_path)
    reader = ExpertReader(layouts, cap=1, lib=LIB, mapper=_plain, threads=2)
    experts = [4, 0, 5]
    out = tuple(torch.zeros(len(experts), r * c, dtype=torch.uint8) for r, c in SHAPES)
    reader.read_parts(3, experts, out)
    for i, e in enumerate(experts):
        for p, rng in enumerate(layouts[3].expert_ranges(e)):
            assert torch.equal(out[p][i], data[rng.offset : rng.offset + rng.nbytes]), (i, p)
    reader.close()


def test_close_stops_the_thread_and_a_closed_reader_is_not_reused(tmp_path):
    _, layouts = _file(tmp_path)
    reader = ExpertReader(layouts, cap=1, lib=LIB, mapper=_plain)
    reader.start()
    reader.start()  # a second start is a no-op
    reader.close()
    reader.close()  # idempotent (the finalizer runs once)
    box = reader.box_host
    box[8], box[2], box[3], box[0] = 0, 0, 1, 1
    time.sleep(0.05)
    assert int(box[1]) == 0  # nobody answers any more


@pytest.mark.parametrize(("cpus", "want"), [(2, 2), (16, 16), (64, 16)])
def test_reads_use_the_cpus_the_process_has_up_to_the_most(tmp_path, monkeypatch, cpus, want):
    from localllm.offload import expert_reads

    monkeypatch.setattr(expert_reads.os, "sched_getaffinity", lambda pid: set(range(cpus)),
                        raising=False)  # fmt: skip
    assert expert_reads.read_threads() == want
    _, layouts = _file(tmp_path)
    reader = ExpertReader(layouts, cap=1, lib=LIB, mapper=_plain)
    try:
        assert reader._threads == want
    finally:
        reader.close()
