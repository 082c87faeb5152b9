"""Cutting long audio into model windows: fixed chunks with overlap, and a seek buffer.

`chunk_spans` serves batch-style chunking; `SeekBuffer` serves Whisper's sequential long-form
decoding, where the next window starts wherever the last decoded segment ended. The buffer
keeps only the samples from the current seek on, so memory stays bounded on hours of audio.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Span:
    """Samples [start, end) of the input."""

    start: int
    end: int


def chunk_spans(n_samples: int, window: int, overlap: int = 0) -> list[Span]:
    """Windows of `window` samples, each starting `window - overlap` after the previous."""
    if window <= 0 or not 0 <= overlap < window:
        raise ValueError("need window > 0 and 0 <= overlap < window")
    spans, start, step = [], 0, window - overlap
    while start < n_samples:
        spans.append(Span(start, min(start + window, n_samples)))
        if start + window >= n_samples:
            break
        start += step
    return spans


class SeekBuffer:
    """Random access to a block stream from a monotonically advancing seek position."""

    def __init__(self, blocks: Iterable[np.ndarray]):
        self._blocks: Iterator[np.ndarray] = iter(blocks)
        self._buf = np.zeros(0, dtype=np.float32)
        self._base = 0  # absolute sample index of self._buf[0]
        self._done = False

    @property
    def exhausted(self) -> bool:
        """True once the stream has ended (so `total` is known)."""
        return self._done

    @property
    def total(self) -> int:
        """Samples seen so far (the whole length once `exhausted`)."""
        return self._base + len(self._buf)

    def _fill(self, upto: int) -> None:
        parts = [self._buf]
        have = self.total
        while have < upto and not self._done:
            block = next(self._blocks, None)
            if block is None:
                self._done = True
                break
            parts.append(np.asarray(block, dtype=np.float32))
            have += len(block)
        if len(parts) > 1:
            self._buf = np.concatenate(parts)

    def has_data(self, seek: int) -> bool:
        """Whether any sample exists at or after `seek`."""
        self._fill(seek + 1)
        return self.total > seek

    def window(self, seek: int, length: int) -> np.ndarray:
        """Samples [seek, seek + length), shorter at the end of the stream; drops what precedes."""
        if seek < self._base:
            raise ValueError("the seek buffer cannot go backwards")
        self._fill(seek + length)
        cut = seek - self._base
        self._buf, self._base = self._buf[cut:], seek
        return self._buf[:length]
