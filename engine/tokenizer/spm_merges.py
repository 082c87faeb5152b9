"""BPE merges for a SentencePiece-style (`llama`) vocabulary, derived from the token scores.

llama.cpp tokenizes these vocabularies by repeatedly joining the adjacent pair of pieces whose
concatenation is a token with the highest score (ties: leftmost pair). A BPE model reproduces that
if it has one merge `(a, b)` for every token `t == a + b` with `a` and `b` tokens themselves, ranked
by the score of `t`. Finding every such split is a loop over ~1.5 M prefixes for a 262k vocabulary,
far too slow in Python, so it is done with numpy: each prefix and suffix is hashed with a polynomial
hash over code points (computed for all substrings at once from prefix sums) and looked up among the
hashes of whole tokens with a sorted search. A 64-bit hash collision could at worst add or drop one
merge.
"""

from __future__ import annotations

import numpy as np

# Odd, so it has an inverse modulo 2**64; any large odd constant works.
_BASE = np.uint64(0x9E3779B97F4A7C15)
_BASE_INV = np.uint64(pow(int(_BASE), -1, 2**64))


def _powers(base: np.uint64, n: int) -> np.ndarray:
    out = np.empty(n, np.uint64)
    if n:
        out[0] = 1
        out[1:] = base
        np.cumprod(out, out=out)  # wraps modulo 2**64, which is what the hash wants
    return out


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: short strings hash to small numbers, and buckets use the top bits."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def derive_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """All `(left, right)` pairs whose concatenation is a token, best score first.

    Pairs that build the same token keep the order of their split point, shorter left part first.
    """
    n_tok = len(tokens)
    lens = np.fromiter(map(len, tokens), np.int64, n_tok)
    flat = "".join(tokens).encode("utf-32-le", "surrogatepass")
    cps = np.frombuffer(flat, np.uint32).astype(np.uint64)
    total = len(cps)
    ends = np.cumsum(lens)
    starts = ends - lens

    with np.errstate(over="ignore"):
        # hash(s, e) = sum_{j in [s, e)} cp[j] * B**(e-1-j) = B**(e-1) * (C[e] - C[s])
        # with C the prefix sums of cp[j] * B**-j.
        pow_b = _powers(_BASE, total + 1)
        pow_inv = _powers(_BASE_INV, total + 1)
        csum = np.zeros(total + 1, np.uint64)
        np.cumsum(cps * pow_inv[:total], out=csum[1:])

        def span_hash(s: np.ndarray, e: np.ndarray) -> np.ndarray:
            return _mix((csum[e] - csum[s]) * pow_b[np.maximum(e - 1, 0)])

        whole = span_hash(starts, ends)
        # Every split point of every token of two or more code points.
        n_splits = np.maximum(lens - 1, 0)
        owner = np.repeat(np.arange(n_tok), n_splits)
        first = np.cumsum(n_splits) - n_splits
        cut = np.arange(len(owner)) - np.repeat(first, n_splits) + 1
        mid = starts[owner] + cut
        left_h = span_hash(starts[owner], mid)
        right_h = span_hash(mid, ends[owner])

    # Look the halves up among whole tokens; with duplicate texts the last id wins, like llama.cpp.
    table = _HashTable(whole)
    left_id = table.lookup(left_h)
    keep = np.flatnonzero(left_id >= 0)  # only look up right halves whose left half is a token
    right_id = table.lookup(right_h[keep])
    ok = right_id >= 0
    keep, right_id = keep[ok], right_id[ok]
    owner, left_id = owner[keep], left_id[keep]

    # Highest score first. `owner` is ascending and splits of one token are in cut order, so a
    # stable sort on the owner's score rank keeps ties deterministic (lower id, shorter left part).
    score_rank = np.empty(n_tok, np.int64)
    score_rank[np.argsort(-scores.astype(np.float64), kind="stable")] = np.arange(n_tok)
    rank = np.argsort(score_rank[owner], kind="stable")
    # Gathering through an object array is one C loop per side instead of a Python call per item.
    texts = np.empty(n_tok, dtype=object)
    texts[:] = tokens
    return list(zip(texts[left_id[rank]].tolist(), texts[right_id[rank]].tolist(), strict=True))


class _HashTable:
    """Vectorized exact lookup of 64-bit hashes: sorted keys bucketed by their top bits.

    A plain `searchsorted` over a million queries is dominated by cache misses; with 2**20 buckets a
    lookup reads one bucket bound and, on average, fewer than one key.
    """

    BITS = 20

    def __init__(self, keys: np.ndarray) -> None:
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]
        top = (self.keys >> np.uint64(64 - self.BITS)).astype(np.int64)
        self.bounds = np.zeros(2**self.BITS + 1, np.int64)
        np.cumsum(np.bincount(top, minlength=2**self.BITS), out=self.bounds[1:])

    def lookup(self, query: np.ndarray) -> np.ndarray:
        bucket = (query >> np.uint64(64 - self.BITS)).astype(np.int64)
        pos = self.bounds[bucket]
        end = self.bounds[bucket + 1]
        found = np.full(len(query), -1, np.int64)
        todo = np.flatnonzero(pos < end)
        while len(todo):
            p = pos[todo]
            hit = self.keys[p] == query[todo]
            # Equal keys sit in id order, so a later hit (a later duplicate id) overwrites.
            found[todo[hit]] = self.order[p[hit]]
            pos[todo] = p + 1
            todo = todo[pos[todo] < end[todo]]
        return found
