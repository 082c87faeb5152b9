"""KV cache manager: exact block tables, prefix hits, eviction order, refusals, forks and stats."""

import pytest

from localllm.engine.core.block_pool import hash_block_tokens
from localllm.engine.core.kv_manager import KVCacheManager, PrefixCacheStats
from localllm.engine.core.request import Request
from localllm.engine.sampling.params import SamplingParams

BS = 4


def _req(rid: str, tokens, **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0, **kw.pop("sp", {})), **kw)


def _queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_queue.get_all_free_blocks()]


def _admit(m: KVCacheManager, r: Request) -> list[int]:
    """One scheduler admission: look up, allocate the rest, compute, cache."""
    hit, n_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n_hit, hit) is not None
    r.num_computed_tokens = r.num_tokens
    m.cache_blocks(r, r.num_tokens)
    return m.get_block_ids(r)


def _state(m: KVCacheManager, *reqs: Request):
    pool = m.pool
    return (
        _queue(m),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached),
        [m.get_block_ids(r) for r in reqs],
    )


def test_block_hashes_follow_the_chain():
    m = KVCacheManager(BS, 8)
    r = _req("r", range(10))
    _admit(m, r)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert r.block_hashes == [h0, h1]  # only full blocks
    assert m.pool.get_cached_block(h0).block_id == 0
    assert m.pool.get_cached_block(h1).block_id == 1


def test_shared_prefix_blocks_and_free_order():
    m = KVCacheManager(BS, 10)
    r1 = _req("r1", [*range(8), 100, 101])
    assert _admit(m, r1) == [0, 1, 2]
    r2 = _req("r2", [*range(8), 200, 201, 202])
    hit, n_hit = m.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0, 1] and n_hit == 8
    assert [b.ref_cnt for b in hit] == [1, 1]  # a lookup alone changes no ref count
    new = m.allocate_slots(r2, r2.num_tokens - n_hit, hit)
    assert [b.block_id for b in new] == [3]
    assert m.get_block_ids(r2) == [0, 1, 3]
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert _queue(m) == [4, 5, 6, 7, 8, 9]
    m.free(r1)
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert _queue(m) == [4, 5, 6, 7, 8, 9, 2]
    m.free(r2)
    assert _queue(m) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]  # reversed: shared prefix evicted last
    assert m.get_block_ids(r2) == [] and m.usage == 0.0


def test_least_recently_freed_cached_block_is_evicted_first():
    m = KVCacheManager(BS, 4)
    r1 = _req("r1", [*range(8), 9])
    assert _admit(m, r1) == [0, 1, 2]
    h0, h1 = r1.block_hashes
    m.free(r1)
    assert _queue(m) == [3, 2, 1, 0]
    other = _req("x", range(50, 59))
    assert _admit(m, other) == [3, 2, 1]  # block 1 was cached: it loses its hash
    assert m.pool.get_cached_block(h1) is None and m.pool.blocks[1].block_hash != h1
    assert m.pool.get_cached_block(h0) is m.pool.blocks[0]
    m.free(other)
    again = _req("again", [*range(8), 9])
    hit, n_hit = m.get_computed_blocks(again)
    assert [b.block_id for b in hit] == [0] and n_hit == 4


@pytest.mark.parametrize(
    ("tokens", "want_blocks"),
    [
        ([99, *range(1, 12)], []),  # first token differs: no hit
        ([*range(4), 99, 5, 6, 7, 8], [0]),  # second block differs: partial
        (list(range(8)), [0]),  # exactly two cached blocks: keep one token to compute
        (list(range(9)), [0, 1]),
        (list(range(12)), [0, 1]),  # 12 tokens: capped at (12 - 1) // 4 = 2 blocks
        (list(range(13)), [0, 1, 2]),
    ],
)
def test_hit_length(tokens, want_blocks):
    m = KVCacheManager(BS, 8)
    _admit(m, _req("src", range(16)))
    hit, n_hit = m.get_computed_blocks(_req("q", tokens))
    assert [b.block_id for b in hit] == want_blocks and n_hit == BS * len(want_blocks)


def test_cache_salt_isolates_requests():
    m = KVCacheManager(BS, 12)
    tokens = list(range(9))
    salted = _req("a", tokens, cache_salt="alice")
    _admit(m, salted)
    assert m.get_computed_blocks(_req("plain", tokens))[1] == 0
    assert m.get_computed_blocks(_req("bob", tokens, cache_salt="bob"))[1] == 0
    assert m.get_computed_blocks(_req("alice2", tokens, cache_salt="alice"))[1] == 8
    plain = _req("p", tokens)
    _admit(m, plain)
    # The salt reaches the second block's hash through the chain, not only the first.
    assert salted.block_hashes[1] != plain.block_hashes[1]


def test_prompt_logprobs_and_caching_off_skip_the_lookup():
    m = KVCacheManager(BS, 8)
    _admit(m, _req("src", range(9)))
    before = PrefixCacheStats(**vars(m.stats))
    r = _req("lp", range(9), sp={"prompt_logprobs": 1})
    assert m.get_computed_blocks(r) == ([], 0)
    assert m.stats == before

    off = KVCacheManager(BS, 8, enable_caching=False)
    a = _req("a", range(9))
    _admit(off, a)
    assert off.pool.cached == {} and all(b.block_hash is None for b in off.pool.blocks)
    assert off.get_computed_blocks(_req("b", range(9))) == ([], 0)
    assert off.stats == PrefixCacheStats()


def test_allocate_slots_refusal_changes_nothing():
    m = KVCacheManager(BS, 4)
    r1 = _req("r1", range(9))
    _admit(m, r1)
    m.free(r1)  # blocks 0 and 1 cached, every block free
    # 17 tokens: 2 hit blocks (free, at ref 0) + 3 new = 5 > 4 blocks. Counting only the 3 new
    # blocks against 4 free would let this through and then run dry halfway.
    big = _req("big", [*range(8), *range(100, 109)])
    hit, n_hit = m.get_computed_blocks(big)
    assert n_hit == 8
    before = _state(m, big)
    assert m.allocate_slots(big, big.num_tokens - n_hit, hit) is None
    assert _state(m, big) == before
    # 16 tokens fit exactly: 2 hits + 2 new blocks.
    fits = _req("fits", [*range(8), *range(100, 108)])
    hit, n_hit = m.get_computed_blocks(fits)
    new = m.allocate_slots(fits, fits.num_tokens - n_hit, hit)
    assert [b.block_id for b in new] == [3, 2] and m.get_block_ids(fits) == [0, 1, 3, 2]
    assert m.num_free_blocks == 0 and m.usage == 1.0


def test_refusal_while_running_keeps_the_table():
    m = KVCacheManager(BS, 4)
    a, b = _req("a", range(8)), _req("b", range(20, 24))
    _admit(m, a)
    _admit(m, b)
    a.append_output(42)
    before = _state(m, a, b)
    assert m.num_blocks_needed(a, 1) == 1
    assert m.allocate_slots(a, 2) is not None  # takes the last block
    a2 = _state(m, a, b)
    assert m.allocate_slots(b, 5) is None  # b needs 2 more blocks, none is free
    assert _state(m, a, b) == a2 != before


def test_decode_caches_blocks_incrementally():
    m = KVCacheManager(BS, 8)
    r = _req("r", range(7))
    assert [b.block_id for b in m.allocate_slots(r, 7)] == [0, 1]
    r.num_computed_tokens = 7
    m.cache_blocks(r, 7)
    assert len(r.block_hashes) == 1 and list(m.pool.cached.values()) == [m.pool.blocks[0]]
    r.append_output(70)
    assert m.num_blocks_needed(r, 1) == 0
    assert m.allocate_slots(r, 1) == []  # token 8 still fits in block 1
    r.num_computed_tokens = 8
    m.cache_blocks(r, 8)
    m.cache_blocks(r, 8)  # idempotent
    h1 = hash_block_tokens(r.block_hashes[0], [4, 5, 6, 70])
    assert r.block_hashes[1] == h1 and m.pool.get_cached_block(h1) is m.pool.blocks[1]
    assert len(m.pool.cached) == 2
    r.append_output(71)
    assert [b.block_id for b in m.allocate_slots(r, 1)] == [2]
    assert m.get_block_ids(r) == [0, 1, 2]


def test_concurrent_identical_prompts_keep_their_own_blocks():
    m = KVCacheManager(BS, 8)
    a, b = _req("a", range(9)), _req("b", range(9))
    m.allocate_slots(a, 9)
    m.allocate_slots(b, 9)  # admitted in the same step: nothing cached yet
    for r in (a, b):
        r.num_computed_tokens = 9
        m.cache_blocks(r, 9)
    assert m.get_block_ids(a) == [0, 1, 2] and m.get_block_ids(b) == [3, 4, 5]
    assert [m.pool.get_cached_block(h).block_id for h in b.block_hashes] == [0, 1]
    assert m.pool.blocks[3].block_hash is None and m.pool.blocks[4].block_hash is None


def test_reset_prefix_cache_drops_hits():
    m = KVCacheManager(BS, 6)
    r = _req("r", range(9))
    _admit(m, r)
    assert m.pool.reset_prefix_cache() is False
    m.free(r)
    assert m.pool.reset_prefix_cache() is True
    assert m.get_computed_blocks(_req("q", range(9))) == ([], 0)


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_prompt_blocks(caching):
    m = KVCacheManager(BS, 8, enable_caching=caching)
    src = _req("src", range(10))
    m.allocate_slots(src, 10)
    src.num_computed_tokens = 10
    m.cache_blocks(src, 10)
    dst = _req("dst", range(10), index=1)
    assert m.fork(src, dst, 10) == 8
    assert m.get_block_ids(dst) == [0, 1]
    assert [b.ref_cnt for b in m.pool.blocks[:3]] == [2, 2, 1]
    dst.num_computed_tokens = 8
    assert [b.block_id for b in m.allocate_slots(dst, 2)] == [3]
    m.free(src)
    assert [b.ref_cnt for b in m.pool.blocks[:4]] == [1, 1, 0, 1]
    assert _queue(m) == [4, 5, 6, 7, 2]
    m.free(dst)
    assert _queue(m) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_fork_keeps_one_token_to_compute():
    m = KVCacheManager(BS, 8)
    src = _req("src", range(8))
    m.allocate_slots(src, 8)
    assert m.fork(src, _req("d1", range(8)), 8) == 4  # 8 tokens: share 1 block, recompute token 8
    assert m.fork(src, _req("d2", range(8)), 1) == 0
    assert [b.ref_cnt for b in m.pool.blocks[:2]] == [2, 1]
    with pytest.raises(ValueError):
        m.fork(src, src, 8)  # src already holds blocks


def test_stats_count_lookups():
    assert PrefixCacheStats().hit_rate == 0.0
    m = KVCacheManager(BS, 8)
    _admit(m, _req("a", range(9)))  # 9 queried, 0 hit
    _admit(m, _req("b", [*range(4), 50, 51, 52]))  # 7 queried, 4 hit
    assert m.stats == PrefixCacheStats(requests=2, queries=16, hits=4)
    assert m.stats.hit_rate == pytest.approx(4 / 16)
