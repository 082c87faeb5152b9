"""Splitting text around special tokens, with llama.cpp's rules.

llama.cpp (`tokenizer_st_partition`) takes the special tokens longest first and, for each, cuts
every occurrence out of the text that is still raw; the pieces in between are tokenized normally.
That is not always the leftmost-longest match a scanner would give (with specials `ab` and `bcd`,
`abcd` yields `a` + `bcd`), so we reproduce it: find every occurrence of every special token, then
accept them in llama.cpp's order, skipping those that overlap an accepted one. Tokens flagged
lstrip/rstrip also eat the ASCII whitespace next to them.

Occurrences are found with one regex compiled from a trie of the special texts (Gemma has ~6k of
them), used as a lookahead so that it reports the longest special token starting at each position;
every other special token starting there is a prefix of that one. That gives the (few) special
texts present; each is then cut out with `str.find`, in llama.cpp's order.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

_ASCII_SPACE = frozenset(" \t\n\v\f\r")  # C isspace(), as llama.cpp strips


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int
    lstrip: bool = False
    rstrip: bool = False


def _trie_pattern(texts: Iterable[str]) -> str:
    """A regex matching the longest of `texts` at a position (greedy optionals prefer longer)."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        parts = []
        for ch in sorted(k for k in node if k):
            child = node[ch]
            run = re.escape(ch)
            # Follow single-child chains without recursing: long tokens stay flat.
            while len(child) == 1 and "" not in child:
                ((nxt, child),) = child.items()
                run += re.escape(nxt)
            parts.append(run + build(child))
        if not parts:
            return ""
        body = parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)


class _Spans:
    """Disjoint (start, end, id) spans kept sorted; id None marks whitespace eaten by a strip."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: list[tuple[int, int, int | None]] = []

    def overlap(self, a: int, b: int) -> tuple[int, int, int | None] | None:
        i = bisect_right(self.starts, a) - 1
        if i >= 0 and self.items[i][1] > a:
            return self.items[i]
        if i + 1 < len(self.items) and self.items[i + 1][0] < b:
            return self.items[i + 1]
        return None

    def add(self, a: int, b: int, token_id: int | None) -> None:
        i = bisect_right(self.starts, a)
        self.starts.insert(i, a)
        self.items.insert(i, (a, b, token_id))


class SpecialSplitter:
    """Cuts special tokens out of text; `split` returns raw strings and token ids in order."""

    def __init__(self, specials: Iterable[SpecialToken]) -> None:
        # Longest (in UTF-8 bytes) first as llama.cpp; equal lengths by id (llama.cpp's order there
        # is unspecified).
        ordered = sorted(
            specials, key=lambda s: (-len(s.text.encode("utf-8", "surrogatepass")), s.id)
        )
        self._by_text: dict[str, tuple[int, SpecialToken]] = {}
        for rank, tok in enumerate(ordered):
            self._by_text.setdefault(tok.text, (rank, tok))
        self._pattern = self._compile(list(self._by_text)) if self._by_text else None

    @staticmethod
    def _compile(texts: list[str]) -> re.Pattern[str]:
        try:
            return re.compile("(?=(" + _trie_pattern(texts) + "))")
        except (RecursionError, re.error, OverflowError):
            # Pathological vocabularies (thousands of nested prefixes): a flat alternation is slower
            # but has no nesting.
            flat = "|".join(map(re.escape, sorted(texts, key=len, reverse=True)))
            return re.compile("(?=(" + flat + "))")

    def split(self, text: str) -> list[str | int]:
        if self._pattern is None or not text:
            return [text] if text else []
        # The special texts present: every one is a prefix of the longest match at its position.
        longest = {m.group(1) for m in self._pattern.finditer(text)}
        present = {
            hit
            for match in longest
            for k in range(1, len(match) + 1)
            if (hit := self._by_text.get(match[:k])) is not None
        }
        if not present:
            return [text]
        spans = _Spans()
        for _, tok in sorted(present, key=lambda h: h[0]):
            self._cut(text, tok, spans)
        return self._assemble(text, spans.items)

    @staticmethod
    def _cut(text: str, tok: SpecialToken, spans: _Spans) -> None:
        """llama.cpp's pass for one special token: every occurrence in the still-raw text."""
        n = len(tok.text)
        pos = text.find(tok.text)
        while pos >= 0:
            end = pos + n
            hit = spans.overlap(pos, end)
            if hit is not None:
                # Inside a cut-out span: resume after it; straddling its start: try one further.
                pos = text.find(tok.text, hit[1] if pos >= hit[0] else pos + 1)
                continue
            spans.add(pos, end, tok.id)
            if tok.rstrip:
                j = end
                while j < len(text) and text[j] in _ASCII_SPACE and spans.overlap(j, j + 1) is None:
                    j += 1
                if j > end:
                    spans.add(end, j, None)
            if tok.lstrip:
                j = pos
                while j > 0 and text[j - 1] in _ASCII_SPACE and spans.overlap(j - 1, j) is None:
                    j -= 1
                if j < pos:
                    spans.add(j, pos, None)
            pos = text.find(tok.text, end)

    @staticmethod
    def _assemble(text: str, spans: list[tuple[int, int, int | None]]) -> list[str | int]:
        out: list[str | int] = []
        pos = 0
        for start, end, token_id in spans:
            if start > pos:
                out.append(text[pos:start])
            if token_id is not None:
                out.append(token_id)
            pos = end
        if pos < len(text):
            out.append(text[pos:])
        return out
