"""Block pool: chained hashes, the free queue's exact order, ref counts, eviction, the hash map."""

import hashlib
import os
import subprocess
import sys

import pytest

from localllm.engine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _queue(pool: BlockPool) -> list[int]:
    return _ids(pool.free_queue.get_all_free_blocks())


# --- hashing ---------------------------------------------------------------------------------


def test_hash_is_a_sha256_digest_and_depends_on_every_input():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == hashlib.sha256().digest_size
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != h
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("other",)
    )


def test_same_block_tokens_under_different_parents_hash_differently():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [3, 4])
    child_a = hash_block_tokens(a, [9, 9])
    child_b = hash_block_tokens(b, [9, 9])
    assert child_a != child_b
    assert child_a != hash_block_tokens(None, [9, 9])
    assert hash_block_tokens(a, [9, 9]) == child_a


def test_encoding_is_unambiguous_across_token_boundaries():
    # Concatenating token text would make these collide; the length-prefixed encoding must not.
    assert hash_block_tokens(None, [12, 3]) != hash_block_tokens(None, [1, 23])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])


def test_hash_is_stable_across_processes():
    # Python's hash() of a str changes per process; a different PYTHONHASHSEED would expose it.
    code = (
        "from localllm.engine.core.block_pool import hash_block_tokens as h\n"
        "p = h(None, [5, 6, 7], ('salt',))\n"
        "print(h(p, [8, 9, 10]).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONSAFEPATH": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    here = hash_block_tokens(hash_block_tokens(None, [5, 6, 7], ("salt",)), [8, 9, 10])
    assert out.stdout.strip() == here.hex()


# --- free queue ------------------------------------------------------------------------------


def test_free_queue_popleft_remove_append_keep_exact_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert _ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4] and q.num_free == 5
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert _ids(q.get_all_free_blocks()) == [1, 3, 4] and q.num_free == 3
    q.append(blocks[0])
    q.append(blocks[2])
    assert _ids(q.get_all_free_blocks()) == [1, 3, 4, 0, 2]
    q.remove(blocks[2])  # the tail
    q.remove(blocks[1])  # the head
    assert _ids(q.get_all_free_blocks()) == [3, 4, 0] and q.num_free == 3
    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not in the queue any more


def test_free_queue_empties_and_refills():
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    q.popleft()
    q.popleft()
    assert q.num_free == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()
    q.append(blocks[1])
    assert q.popleft() is blocks[1]


# --- pool ------------------------------------------------------------------------------------


def test_get_new_blocks_pops_the_head_and_sets_ref_counts():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert _ids(got) == [0, 1, 2] and [b.ref_cnt for b in got] == [1, 1, 1]
    assert _queue(pool) == [3, 4, 5] and pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert _queue(pool) == [3, 4, 5]  # a refused request takes nothing


def test_free_blocks_appends_in_the_given_order_when_refs_reach_zero():
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    pool.touch([b])  # b is shared: ref 2
    pool.free_blocks([c, b, a])
    assert (a.ref_cnt, b.ref_cnt, c.ref_cnt) == (0, 1, 0)
    assert _queue(pool) == [3, 4, 2, 0]
    pool.free_blocks([b])
    assert _queue(pool) == [3, 4, 2, 0, 1] and pool.usage == 0.0
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.free_blocks([a])
    assert _queue(pool) == [1, 2, 3, 0] and pool.num_free_blocks == 4
    assert pool.get_cached_block(h) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and _queue(pool) == [1, 2, 3] and pool.num_free_blocks == 3
    pool.touch([a])  # already in use: only the count moves
    assert a.ref_cnt == 2 and _queue(pool) == [1, 2, 3]


def test_popping_a_cached_block_evicts_its_hash():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    for blk, h in zip(blocks, hashes, strict=True):
        pool.cache_block(blk, h)
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])
    assert _queue(pool) == [1, 0, 2]
    (got,) = pool.get_new_blocks(1)
    assert got is blocks[1] and got.block_hash is None and got.ref_cnt == 1
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert set(pool.cached) == {hashes[0], hashes[2]}


def test_cache_block_does_not_deduplicate():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.cache_block(a, hash_block_tokens(None, [8]))  # already cached under h: unchanged
    assert a.block_hash == h and list(pool.cached) == [h]


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(ha) is a and a.block_hash == ha
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and a.block_hash is None and b.block_hash is None
    assert pool.get_cached_block(ha) is None and pool.num_free_blocks == 3


def test_caching_off_never_remembers_hashes():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_block(a, h)
    assert a.block_hash is None and pool.get_cached_block(h) is None
