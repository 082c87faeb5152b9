"""Draft-free speculative decoding: propose the tokens that followed the last n-gram before.

Prompt lookup: when the sequence's last n tokens appeared earlier (in the prompt or the output),
the tokens that came after them are a cheap guess for what comes next. The runner verifies the
guess exactly, so output never changes; only the number of forward passes does.
"""

import numpy as np


class NgramProposer:
    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 1):
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to `num_tokens` (and `limit`) drafts; the longest matching n-gram wins, then the
        most recent occurrence of it."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        seq = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            suffix = seq[-n:]
            # Windows starting at 0 .. len-n-1 (the suffix itself is excluded).
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []
