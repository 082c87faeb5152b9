"""The multimodal seam: embeddings that replace placeholder tokens' embeddings at prefill.

A request may carry `MultiModalInput`s (an image, ...): the prompt positions of its placeholder
tokens plus either precomputed embeddings or an encoder callable. The engine never imports
media: it only runs the callable, on its own thread, the first time a prefill step reaches the
item, and keeps the result in an `EncoderCache` keyed by the content hash (a repeated image is
encoded once). The same hash goes into the prefix-cache keys of the KV blocks the item covers,
so two prompts with the same tokens but different images never share KV. A step that computes
only part of an item's positions (chunked prefill, a partial prefix-cache hit) takes just the
rows it needs.

M-RoPE models (Qwen2-VL and later) turn each token by three position axes (temporal, height,
width): an item may carry its placeholders' grid positions (`rope`), and `RopePositions` lays
out a request's whole prompt once, at admission, as the Hugging Face `get_rope_index` does: text
counts on by one on all axes, an item sits at its grid offset from where the text stopped, and
the text after it resumes `rope_advance` further on. Tokens past the table (decode) sit at their
index plus `delta`, the same on every axis, which plain rope computes.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ENCODER_CACHE_BYTES = 256 * 1024 * 1024  # encoder outputs kept for reuse, on their device


@dataclass(frozen=True, eq=False, slots=True)
class MultiModalInput:
    """One item of a prompt. `positions`: the prompt positions (strictly increasing) whose token
    embeddings are replaced, row i by row i of the item's embeddings [len(positions), dim].
    Exactly one of `embeds` and `encoder` (called with no arguments on the engine thread)."""

    content_hash: str  # names the content and everything that shapes its embeddings
    positions: tuple[int, ...]
    embeds: torch.Tensor | None = None
    encoder: Callable[[], torch.Tensor] | None = None
    # M-RoPE: per placeholder its (t, h, w) offsets [3, len(positions)] int64, and how far the
    # text after the item moves on (positions must then be contiguous)
    rope: torch.Tensor | None = None
    rope_advance: int = 0

    def __post_init__(self) -> None:
        if not self.positions:
            raise ValueError("a multimodal input needs at least one placeholder position")
        if (self.embeds is None) == (self.encoder is None):
            raise ValueError("a multimodal input takes embeds or an encoder, exactly one")
        if any(b <= a for a, b in zip(self.positions, self.positions[1:], strict=False)):
            raise ValueError("multimodal placeholder positions must be strictly increasing")
        if self.rope is not None:
            if tuple(self.rope.shape) != (3, len(self.positions)):
                raise ValueError("multimodal rope positions need shape [3, placeholders]")
            if self.end - self.start != len(self.positions):
                raise ValueError("an item with rope positions needs contiguous placeholders")

    @property
    def start(self) -> int:
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past the last placeholder position."""
        return self.positions[-1] + 1


def check_inputs(items: Sequence[MultiModalInput], num_tokens: int, dim: int) -> None:
    """ValueError unless the items lie inside the prompt, in order, without overlap, and given
    embeddings have one row of width `dim` per position."""
    last = -1
    for i, item in enumerate(items):
        if item.start <= last:
            raise ValueError(f"multimodal input {i} overlaps or precedes the one before it")
        if item.end > num_tokens:
            raise ValueError(
                f"multimodal input {i} has a placeholder at position {item.end - 1}, beyond the "
                f"prompt's {num_tokens} tokens"
            )
        if item.embeds is not None:
            _check_rows(item, item.embeds, dim)
        last = item.end - 1


def _check_rows(item: MultiModalInput, embeds: torch.Tensor, dim: int) -> None:
    want = (len(item.positions), dim)
    if embeds.dim() != 2 or tuple(embeds.shape) != want:
        raise ValueError(
            f"multimodal embeddings have shape {tuple(embeds.shape)}, expected {want} "
            "(one row of the model's width per placeholder)"
        )


def block_extra_keys(items: Sequence[MultiModalInput], start: int, end: int) -> tuple[str, ...]:
    """Content hashes of the items with a placeholder in positions [start, end): what a KV block
    over those positions depends on beyond its tokens."""
    return tuple(it.content_hash for it in items if it.start < end and it.end > start)


@dataclass(frozen=True, eq=False, slots=True)
class RopePositions:
    """A request's M-RoPE positions: `table` [3, prompt tokens] int64 (host), and `delta`, what
    a token past the prompt adds to its index on every axis."""

    table: torch.Tensor
    delta: int

    @staticmethod
    def of(items: Sequence[MultiModalInput], num_tokens: int) -> "RopePositions | None":
        """The layout of a prompt of `num_tokens` with these items, or None when no item carries
        rope positions (plain rope)."""
        if not any(it.rope is not None for it in items):
            return None
        cols, cur, p = [], 0, 0
        for it in items:
            if it.rope is None:
                raise ValueError("every multimodal input of an M-RoPE prompt needs rope positions")
            n = it.start - p
            cols.append(torch.arange(cur, cur + n).expand(3, n))
            cols.append(it.rope.to(torch.long) + (cur + n))
            cur += n + it.rope_advance
            p = it.end
        n = num_tokens - p
        cols.append(torch.arange(cur, cur + n).expand(3, n))
        table = torch.cat(cols, 1)
        return RopePositions(table, int(table.max()) + 1 - num_tokens)

    def rows(self, start: int, n: int) -> torch.Tensor:
        """Positions [3, n] of tokens start..start+n-1."""
        known = self.table.shape[1]
        head = self.table[:, start : start + n]
        if start + n <= known:
            return head
        first = max(start, known)
        tail = torch.arange(first, start + n) + self.delta
        return torch.cat((head, tail.expand(3, -1)), 1)

    def flat(self, p: int) -> int | None:
        """Token p's position when all three axes agree (text), else None."""
        if p >= self.table.shape[1]:
            return p + self.delta
        t, h, w = self.table[:, p].tolist()
        return t if t == h == w else None


class EncoderCache:
    """Encoder outputs by content hash, least recently used dropped first past `max_bytes`."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = self.misses = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, item: MultiModalInput, dim: int, device: torch.device) -> torch.Tensor:
        """The item's embeddings [len(positions), dim] on `device`, encoding it on a miss."""
        if item.embeds is not None:
            return item.embeds.to(device)
        out = self._items.get(item.content_hash)
        if out is not None:
            self.hits += 1
            self._items.move_to_end(item.content_hash)
            return out
        self.misses += 1
        out = item.encoder().to(device)
        _check_rows(item, out, dim)
        self._items[item.content_hash] = out
        self.nbytes += out.numel() * out.element_size()
        while self.nbytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
        return out


def step_embeds(
    items: Sequence[MultiModalInput],
    start: int,
    n: int,
    base: int,
    cache: EncoderCache,
    dim: int,
    device: torch.device,
) -> tuple[list[int], list[torch.Tensor]]:
    """(flat batch rows, embedding rows) for the placeholders among positions [start, start+n)
    of one request whose first new token sits at flat row `base`."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    for item in items:
        if item.end <= start or item.start >= start + n:
            continue
        idx = [i for i, p in enumerate(item.positions) if start <= p < start + n]
        embeds = cache.get(item, dim, device)
        rows += [base + item.positions[i] - start for i in idx]
        values.append(embeds[idx[0] : idx[-1] + 1])  # a window of sorted positions: one slice
    return rows, values


def pending(items: Sequence[MultiModalInput], start: int, n: int) -> bool:
    """Whether positions [start, start+n) hold a placeholder (the step needs the embeddings)."""
    return any(it.start < start + n and it.end > start for it in items)
