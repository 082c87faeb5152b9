"""File mappings on 2 MiB pages (`offload.ranges.HUGE_PAGES`, issue 39): the advice reaches the
kernel (the mapping's VmFlags in /proc/self/smaps), is a silent no-op where the platform has none
or the kernel refuses it, and a model loaded under every setting computes the same bits, close to
transformers' fp32 logits.

Whether the kernel then maps the file with 2 MiB entries depends on its file system and on the
folios already cached (not testable here); tests/perf/ab_hugepages.py measures it.
"""

import dataclasses
import mmap
import sys

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.offload import ByteRange, MappedFile, ranges
from tests.engine.family_goldens import golden_logits, path, sequence
from tests.perf.make_synthetic import SHAPES, write_synthetic

SETTINGS = [True, False, None]
FLAG = {True: "hg", False: "nh"}  # smaps VmFlags of MADV_HUGEPAGE / MADV_NOHUGEPAGE
LOGIT_TOL = 1e-4  # fp32 both sides, other summation orders (as the family goldens' tests)
BLOCK = 4


def _vm_flags(addr: int) -> set[str]:
    """VmFlags of the mapping (after madvise splits: the part) that holds `addr`."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping at {addr:#x}")


@pytest.mark.skipif(sys.platform != "linux", reason="madvise flags are read from Linux's smaps")
@pytest.mark.parametrize("huge", SETTINGS)
def test_advice_reaches_the_kernel(tmp_path, monkeypatch, huge):
    data = bytes(range(256)) * (4 << 12)  # 4 MiB: two 2 MiB pages
    (tmp_path / "w.bin").write_bytes(data)
    monkeypatch.setattr(ranges, "HUGE_PAGES", huge)
    mf = MappedFile(tmp_path / "w.bin")
    view = mf.view(ByteRange(mf.path, 0, len(data)))
    flags = _vm_flags(view.data_ptr())
    assert mf.huge_pages is huge
    assert {f for f in FLAG.values() if f in flags} == ({FLAG[huge]} if huge is not None else set())
    assert bytes(view[1000:1300].numpy()) == data[1000:1300]


@pytest.mark.skipif(sys.platform != "linux", reason="madvise flags are read from Linux's smaps")
def test_an_untied_embedding_table_stays_on_small_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(ranges, "HUGE_PAGES", True)
    gguf = tmp_path / "tiny.gguf"
    write_synthetic(gguf, SHAPES["tiny"], "Q4_K_M", None, seed=3)  # 49152 x 256 Q4_K: 6.75 MiB
    with open_gguf(gguf) as g:
        assert "output.weight" in g.tensors  # untied
        embd, head = g.weight("token_embd.weight").data, g.weight("output.weight").data
        assert "nh" in _vm_flags(embd[embd.shape[0] // 2].data_ptr())
        assert "hg" in _vm_flags(head[head.shape[0] // 2].data_ptr())


def test_range_advice_needs_whole_pages_and_the_mapping_advised(tmp_path, monkeypatch):
    (tmp_path / "w.bin").write_bytes(bytes(3 * mmap.PAGESIZE))
    mf = MappedFile(tmp_path / "w.bin")
    assert mf.advise(ByteRange(mf.path, 1, 2 * mmap.PAGESIZE), huge=False) is (
        mf.huge_pages is not None
    )  # the one whole page inside: [PAGESIZE, 2 * PAGESIZE)
    assert not mf.advise(ByteRange(mf.path, 1, mmap.PAGESIZE), huge=False)  # no whole page
    monkeypatch.setattr(ranges, "HUGE_PAGES", None)
    unadvised = MappedFile(tmp_path / "w.bin")
    assert not unadvised.advise(ByteRange(mf.path, 0, 3 * mmap.PAGESIZE), huge=False)


def test_no_advice_is_a_silent_no_op(tmp_path, monkeypatch):
    (tmp_path / "w.bin").write_bytes(b"abcdefgh" * 1024)
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)  # as on macOS and Windows
    mf = MappedFile(tmp_path / "w.bin")
    assert mf.huge_pages is None
    assert bytes(mf.view(ByteRange(mf.path, 8, 8)).numpy()) == b"abcdefgh"


def test_a_refused_advice_is_a_silent_no_op():
    class Refusing:  # a kernel without transparent huge pages answers EINVAL
        def madvise(self, advice):
            raise OSError(22, "Invalid argument")

    assert ranges._advise_pages(Refusing(), True) is None
    assert ranges._advise_pages(None, True) is None


@torch.inference_mode()
def _logits(gguf_path, precise: bool) -> torch.Tensor:
    """Logits of a prompt then two one-row steps (the native linears read the mapping)."""
    g = open_gguf(gguf_path)
    try:
        model = build_model(g, precise=precise)
        ids = sequence("smollm3")[:10]
        layers, kv_heads, head_dim = model.kv_shape()
        kv = PagedKVCache(layers, -(-len(ids) // BLOCK), BLOCK, kv_heads, head_dim, dtype="f32")
        out = []
        for s, e in ((0, 8), (8, 9), (9, 10)):
            batch = BatchMeta.contiguous(e - s, e, BLOCK)
            out.append(model.logits(model(torch.tensor(ids[s:e]), torch.arange(s, e), batch, kv)))
        return torch.cat(out)
    finally:
        g.close()


def test_family_model_same_bits_under_every_setting(monkeypatch):
    got = {}
    for huge in SETTINGS:
        monkeypatch.setattr(ranges, "HUGE_PAGES", huge)
        got[huge] = _logits(path("smollm3"), precise=True)
    want = golden_logits("smollm3")[:10]
    assert (got[True] - want).abs().max().item() < LOGIT_TOL
    assert all(torch.equal(got[True], v) for v in got.values())


def test_native_quant_model_same_bits_under_every_setting(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    write_synthetic(gguf, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q4_K_M", None, seed=3)
    got = {}
    for huge in SETTINGS:
        monkeypatch.setattr(ranges, "HUGE_PAGES", huge)
        got[huge] = _logits(gguf, precise=False)
    assert torch.isfinite(got[True]).all()
    assert all(torch.equal(got[True], v) for v in got.values())
