"""The paged-KV block pool: block ids, ref counts, the free queue in eviction order, the hash map.

Pure bookkeeping (vLLM v1 style): the KV tensors live with the runner; this module only decides
which block ids a request may write. A block whose ref count drops to 0 keeps its hash and stays
findable by prefix caching until it is popped from the free queue for a new owner.
"""

import hashlib
import struct
from collections.abc import Iterable, Sequence

BlockHash = bytes  # a sha256 digest


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Chained hash of one full block; `extra_keys` holds str/int/None/tuples (stable reprs)."""
    h = hashlib.sha256()
    # Length prefixes keep the encoding unambiguous: (parent, tokens, extras) -> bytes is injective.
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, head evicted first; O(1) popleft, remove and append."""

    def __init__(self, blocks: Sequence[KVBlock]):
        # Sentinels at both ends remove every empty-list special case.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise ValueError("no free blocks")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def get_all_free_blocks(self) -> list[KVBlock]:
        out = []
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict: its KV is about to be overwritten
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, h: BlockHash) -> KVBlock | None:
        return self.cached.get(h)  # always empty with caching off: cache_block is a no-op

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, h: BlockHash) -> None:
        # A second block with the same content stays uncached: block tables are append-only.
        if not self.enable_caching or block.block_hash is not None or h in self.cached:
            return
        block.block_hash = h
        self.cached[h] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
