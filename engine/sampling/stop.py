"""Stop strings on streamed text: what may be emitted now, and which stop string ended the output.

Text arrives in deltas (one detokenized step at a time), so a stop string can be split across
several of them. The checker holds back the longest tail that could still grow into a stop string,
so a stop string is never half-emitted, and matches whatever way the text was chunked.
"""

from collections.abc import Sequence


class StopChecker:
    """Feed decoded deltas with `add`; call `flush` at the end when nothing matched.

    When several stop strings occur, the one that is complete first in the text wins (ties: the
    one that starts first), which is what a token-by-token stream would have seen first.
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False):
        if isinstance(stop, str):
            stop = (stop,)
        self.stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""
        self._longest = max((len(s) for s in self.stop), default=0)

    def add(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched or None).

        After a match nothing more is ever emitted: later calls return ("", None).
        """
        if self.matched is not None:
            return "", None
        text = self._held + delta
        if not self.stop:
            self._held = ""
            return text, None
        hit = self._first_match(text)
        if hit is not None:
            start, s = hit
            self.matched = s
            self._held = ""
            return text[: start + len(s)] if self.include_stop else text[:start], s
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Releases the held-back tail (a stop-string prefix that never completed)."""
        if self.matched is not None:
            return ""
        out, self._held = self._held, ""
        return out

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = text.find(s)
            if start < 0:
                continue
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[len(text) - n :]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0
