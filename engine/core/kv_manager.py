"""The KV cache manager the scheduler calls: per-request block tables, prefix-cache lookups, forks.

It maps request ids to block lists over one `BlockPool` and keeps each request's chained block
hashes (`request.block_hashes`) up to date. It hands out block ids only; no tensors. For a model
with recurrent state it also hands out state slots (`StateSlots`) with the blocks.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from localllm.engine.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from localllm.engine.core.request import Request
from localllm.engine.core.state_slots import StateSlots
from localllm.engine.multimodal import block_extra_keys


@dataclass
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, block_size: int, num_blocks: int, enable_caching: bool = True, state_slots: int = 0
    ):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        # `state_slots`: a recurrent-state model's slots (0: none). Its state after a cached
        # prefix is not kept, so prefix caching is off for it.
        self.states = StateSlots(state_slots) if state_slots else None
        enable_caching = enable_caching and self.states is None
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        # Per request: how many leading blocks were already offered to the pool's hash map.
        self._num_cached: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to every full block among its first num_tokens tokens."""
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            # The salt goes into the first hash only; the chain carries it to every later block.
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
            if request.mm_inputs:  # the images a block's tokens stand for are part of its key
                extra += block_extra_keys(request.mm_inputs, i * bs, (i + 1) * bs)
            tokens = request.token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash_block_tokens(parent, tokens, extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        # Keep at least one token to compute: its logits produce the next token.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        num_hit = len(hit) * self.block_size
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit
        return hit, num_hit

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        have = len(self._blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + num_new_tokens
        return max(0, _cdiv(total, self.block_size) - have)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> list[KVBlock] | None:
        blocks = self._blocks.get(request.request_id, [])
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total += num_new_tokens
        num_new = max(0, _cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks))
        # Touching an evictable hit takes it out of the free queue, so it costs free capacity too.
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new + evictable_hits > self.pool.num_free_blocks:
            return None
        if self.states is not None and self.states.take(request.request_id) is None:
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if new_computed_blocks and len(blocks) == len(new_computed_blocks):
            # Hit blocks are cached already; cache_blocks can start after them.
            self._num_cached[request.request_id] = len(new_computed_blocks)
        new = self.pool.get_new_blocks(num_new)
        blocks.extend(new)
        self._blocks[request.request_id] = blocks
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        blocks = self._blocks.get(request.request_id, [])
        start = self._num_cached.get(request.request_id, 0)
        end = min(min(num_tokens, request.num_tokens) // self.block_size, len(blocks))
        if end <= start:
            return
        self._update_hashes(request, end * self.block_size)
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = end

    def free(self, request: Request) -> None:
        # Reverse order: the request's tail blocks become the first to be evicted, the shared
        # prefix (most likely to be hit again) the last.
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
        if self.states is not None:
            self.states.release(request.request_id)

    def fork(self, src: Request, dst: Request, num_tokens: int) -> int:
        if self._blocks.get(dst.request_id):
            raise ValueError(f"{dst.request_id} already holds blocks")
        src_blocks = self._blocks.get(src.request_id, [])
        n = min(max(0, (num_tokens - 1) // self.block_size), len(src_blocks))
        if self.states is not None and n:
            # the state exists only where src is now: share (and copy it) only from exactly there
            here = src.num_computed_tokens == n * self.block_size
            if not here or not self.states.copy(src.request_id, dst.request_id):
                n = 0
        shared = src_blocks[:n]
        self.pool.touch(shared)
        self._blocks[dst.request_id] = list(shared)
        return n * self.block_size

    def fork_point(self, num_prompt_tokens: int) -> int:
        """Tokens of a prompt whose KV forks of n > 1 share (the full blocks short of its last
        token); a stateful model's prompt pauses there so its state can be copied."""
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def get_state_slot(self, request: Request) -> int | None:
        return None if self.states is None else self.states.get(request.request_id)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(src, dst) state slots to copy before the next step's forward (forks)."""
        return [] if self.states is None else self.states.take_copies()

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(request.request_id, ())]
