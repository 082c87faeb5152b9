"""engine.runtime.kv_cache and engine.core.batch: sizes, slot writes, and attention through the
cache API.

Attention goes through PagedKVCache.write/attend over several steps (a chunked prefill then decodes)
with out-of-order block tables; the reference is plain dense attention over each sequence's full
float32 K/V.
"""

import math

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.attention import quantize_fp8, quantize_q8_0

DTYPES = ["f32", "f16", "bf16", "q8_0", "fp8"]


def test_contiguous_batch_meta():
    m = BatchMeta.contiguous(3, 21, block_size=8, first_block=5)
    assert m.query_start == (0, 3) and m.seq_lens == (21,) and m.num_seqs == 1
    assert m.block_tables == ((5, 6, 7),)  # ceil(21 / 8) blocks
    assert m.slot_mapping.tolist() == [58, 59, 60]  # positions 18..20 from slot 5 * 8 = 40
    assert m.slot_mapping.dtype == torch.int64


def test_from_tables_slot_mapping():
    m = BatchMeta.from_tables((2, 1), (9, 4), ((3, 0, 7), (6,)), block_size=4)
    assert m.query_start == (0, 2, 3)
    # sequence 0: position 7 -> block 1 (id 0) offset 3, position 8 -> block 2 (id 7) offset 0
    # sequence 1: position 3 -> block 0 (id 6) offset 3
    assert m.slot_mapping.tolist() == [3, 28, 27]


def test_batch_meta_rejects_inconsistent_layouts():
    with pytest.raises(ValueError, match="cannot hold"):
        BatchMeta((0, 1), (9,), ((0, 1),), torch.tensor([8]), 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        BatchMeta((0, 2), (2,), ((0,),), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="B\\+1"):
        BatchMeta((0,), (2,), ((0,),), torch.tensor([], dtype=torch.long), 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sizes(dtype):
    per_block = PagedKVCache.bytes_per_block(3, 16, 2, 64, dtype, v_head_dim=32)
    vec = {"f32": (256, 128), "f16": (128, 64), "bf16": (128, 64)}
    vec |= {"q8_0": (64 + 4, 32 + 2), "fp8": (64 + 4, 32 + 4)}  # values + scales
    assert per_block == 3 * 16 * 2 * sum(vec[dtype])
    cache = PagedKVCache(3, 5, 16, 2, 64, dtype=dtype, v_head_dim=32)
    assert cache.nbytes == 5 * per_block
    assert (cache.num_blocks, cache.block_size, cache.dtype) == (5, 16, dtype)


def test_unknown_dtype_and_block_size_mismatch():
    with pytest.raises(ValueError, match="q4"):
        PagedKVCache(1, 2, 16, 1, 8, dtype="q4")
    cache = PagedKVCache(1, 2, 16, 1, 8)
    with pytest.raises(ValueError, match="block size"):
        cache.attend(0, torch.randn(1, 1, 8), BatchMeta.contiguous(1, 1, 8), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_lands_at_slots_of_one_layer(dtype):
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(2, 4, 6, 2, 32, dtype=dtype)
    for t in (*cache.k, *cache.v, *(cache.k_scales or ()), *(cache.v_scales or ())):
        t.view(torch.uint8).zero_()  # the pool starts uninitialised; zero it to see every write
    k, v = torch.randn(2, 3, 2, 32, generator=gen).unbind(0)
    slots = torch.tensor([20, 3, 11])
    cache.write(1, k, v, slots)
    blk, off = slots // 6, slots % 6
    for x, vals, scales in ((k, cache.k, cache.k_scales), (v, cache.v, cache.v_scales)):
        assert vals[0].view(torch.uint8).count_nonzero() == 0  # layer 0 untouched
        got = vals[1][blk, off] if dtype != "fp8" else vals[1].view(torch.uint8)[blk, off]
        rest = torch.ones(4, 6, dtype=torch.bool)
        rest[blk, off] = False
        assert vals[1].view(torch.uint8)[rest].count_nonzero() == 0  # nothing else written
        if dtype == "q8_0":
            q, s = quantize_q8_0(x)
            assert torch.equal(got, q) and torch.equal(scales[1][blk, off], s)
        elif dtype == "fp8":
            q, s = quantize_fp8(x)
            assert torch.equal(got, q.view(torch.uint8)) and torch.equal(scales[1][blk, off], s)
        else:
            assert scales is None
            assert torch.equal(got, x.to(vals[1].dtype))


def dense(q, k, v, scale):
    """Causal GQA attention of the last len(q) positions of k/v, float64."""
    t, n = q.shape[0], k.shape[0]
    heads = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    s = torch.einsum("thd,nhd->htn", q.double(), k.double()[:, heads]) * scale
    s = s.masked_fill(torch.arange(n)[None] > torch.arange(n - t, n)[:, None], -math.inf)
    return torch.einsum("htn,nhd->thd", s.softmax(-1), v.double()[:, heads])


def run_steps(dtype):
    """Two sequences through PagedKVCache: a joint prefill step, then 3 joint decode steps.
    Returns (outputs per step, references per step)."""
    gen = torch.Generator().manual_seed(7)
    bs, heads, kvh, d = 5, 6, 2, 32
    tables = ((9, 2, 6, 0, 11), (4, 10, 1, 7))  # out of order: 25 and 20 slots
    cache = PagedKVCache(2, 12, bs, kvh, d, dtype=dtype)
    n_final = (23, 18)
    ks = [torch.randn(n, kvh, d, generator=gen) for n in n_final]
    vs = [torch.randn(n, kvh, d, generator=gen) for n in n_final]
    steps = [((20, 15), (20, 15))] + [((1, 1), (20 + i, 15 + i)) for i in range(1, 4)]
    outs, refs = [], []
    for num_new, lens in steps:
        meta = BatchMeta.from_tables(num_new, lens, tables, bs)
        q = torch.randn(sum(num_new), heads, d, generator=gen)
        new = list(enumerate(zip(num_new, lens, strict=True)))
        k = torch.cat([ks[b][n - t : n] for b, (t, n) in new])
        v = torch.cat([vs[b][n - t : n] for b, (t, n) in new])
        cache.write(1, k, v, meta.slot_mapping)
        outs.append(cache.attend(1, q, meta, d**-0.5))
        qs = q.split(list(num_new))
        refs.append(
            torch.cat([dense(qs[b], ks[b][:n], vs[b][:n], d**-0.5) for b, n in enumerate(lens)])
        )
    return outs, refs


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [("f32", 2e-5), ("f16", 3e-3), ("bf16", 2e-2), ("q8_0", 4e-2), ("fp8", 0.2)],
)
def test_attend_over_steps_matches_dense(dtype, tol):
    """f32 is exact up to float rounding; the others within `tol` of it (about twice the kernel
    test's measured max errors), and not equal to it: the storage format really is used."""
    outs, refs = run_steps(dtype)
    errs = [(o.double() - r).abs().max().item() for o, r in zip(outs, refs, strict=True)]
    assert max(errs) < tol, errs
    if dtype != "f32":
        assert min(errs) > 1e-5, errs
