"""Size and format checks used by the chat-template sandbox (`sandbox.BoundedEnvironment`).

Each check runs *before* an operation that can multiply sizes, on numbers that are cheap to get
(lengths, counts), so that a hostile template is refused before anything huge is allocated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

MAX_POW_BITS = 1 << 20
MAX_RANGE = 100_000
# Python code generated from a template, compiled by `compile()` in one uninterruptible call (about
# 0.5 s per MiB): 55x what the largest real template we know (gpt-oss, 17 KB) generates.
MAX_CODE_CHARS = 2 << 20
# Memory one filter or string method may take to turn a string into one object per character,
# word or line (`|title` on 4 MB peaked at 350-600 MB before this).
MAX_FILTER_BYTES = 64 << 20
# Peak bytes per character of a *string* input for the filters that make one Python object per
# character, word or line of it: the worst of ASCII words, one-character runs, lines and CJK text,
# measured with tracemalloc on CPython 3.11, rounded up. Other filters copy a string once or twice
# and the size cap covers them; on a list every filter makes at most a reference per item.
STRING_FILTER_BYTES = {
    "sort": 256,
    "groupby": 192,
    "batch": 192,
    "slice": 144,
    "join": 96,
    "list": 96,
    "map": 96,
    "select": 96,
    "reject": 96,
    "selectattr": 96,
    "rejectattr": 96,
    "unique": 96,
    "title": 96,
    "pprint": 96,
    "urlize": 96,
    "wordwrap": 64,
    "wordcount": 48,
    "urlencode": 48,
    "indent": 48,
    "striptags": 48,
}
# str.split()/rsplit() without a separator: a piece per two characters at worst ("中 中 ...");
# with one, each of the s.count(sep) + 1 pieces costs an object and its characters.
SPLIT_BYTES_PER_CHAR = 48
PIECE_BYTES = 96
# A %-format or str.format width/precision of 7+ digits (or `*`) could allocate gigabytes at once.
_BIG_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{7,})|%[-#0 +]*\d*\.(\*|\d{7,})|\{[^{}]*\d{7,}[^{}]*\}")


class TemplateLimitError(RuntimeError):
    """A template went over a time or size limit."""


class Checker(Protocol):
    def check_size(self, size: int, what: str) -> None: ...

    def limit(self) -> int: ...


def is_seq(value: Any) -> bool:
    return isinstance(value, str | list | tuple)


def value_size(value: Any, limit: int, depth: int = 0) -> int:
    """Roughly how many characters `str(value)` has; stops counting past `limit`."""
    if isinstance(value, str):
        return len(value)
    if depth > 50:
        return limit + 1  # deeper than any sane prompt data, or a cycle
    if isinstance(value, Mapping):
        items: Iterable[Any] = (x for kv in value.items() for x in kv)
    elif isinstance(value, list | tuple | set | frozenset):
        items = value
    else:
        return 16
    total = 2
    for item in items:
        total += value_size(item, limit, depth + 1) + 2
        if total > limit:
            break
    return total


def check_format(fmt: str) -> None:
    if _BIG_WIDTH.search(fmt):
        raise TemplateLimitError("a format string asks for an enormous field width")


def string_method_bytes(s: str, name: str, args: tuple, kwargs: dict) -> int:
    """Peak bytes of the pieces `s.<name>(...)` would make (0: a method that makes none)."""
    if name in ("split", "rsplit"):
        sep = args[0] if args else kwargs.get("sep")
        if isinstance(sep, str) and sep:
            return (s.count(sep) + 1) * PIECE_BYTES + 4 * len(s)
        return SPLIT_BYTES_PER_CHAR * len(s)
    if name == "splitlines":
        return SPLIT_BYTES_PER_CHAR * len(s)
    return 0


def _pre_center(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    width = args[0] if args else kwargs.get("width", 80)
    if isinstance(width, int):
        env.check_size(width, "filter center")


def _pre_indent(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    width = args[0] if args else kwargs.get("width", 4)
    w = len(width) if isinstance(width, str) else int(width) if isinstance(width, int) else 4
    text = str(s) if isinstance(s, str) else ""
    env.check_size(len(text) + (text.count("\n") + 1) * max(w, 0), "filter indent")


def _pre_replace(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    if isinstance(s, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = s.count(old) if old else len(s) + 1
        env.check_size(len(s) + count * len(new), "filter replace")


def _pre_join(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    sep = args[0] if args else kwargs.get("d", "")
    if isinstance(s, list | tuple):
        env.check_size(value_size(s, env.limit()) + len(s) * len(str(sep)), "filter join")


def _pre_wordwrap(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    width = args[0] if args else kwargs.get("width", 79)
    wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
    if isinstance(s, str) and isinstance(width, int):
        env.check_size(len(s) + (len(s) // max(width, 1) + 1) * len(str(wrap)), "filter wordwrap")


def _pre_format(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    if isinstance(s, str):
        check_format(s)
        env.check_size(len(s) + value_size(list(args), env.limit()), "filter format")


def _pre_slice(env: Checker, s: Any, args: list, kwargs: dict) -> None:
    slices = args[0] if args else kwargs.get("slices", 1)
    if isinstance(slices, int) and slices > MAX_RANGE:
        raise TemplateLimitError("filter slice: too many slices")


FILTER_CHECKS = {
    "slice": _pre_slice,
    "center": _pre_center,
    "indent": _pre_indent,
    "replace": _pre_replace,
    "join": _pre_join,
    "wordwrap": _pre_wordwrap,
    "format": _pre_format,
}


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """HF's `tojson` (no HTML escaping, unlike jinja's), with a bounded indent."""
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > 16:
        raise TemplateLimitError("tojson indent is too large")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
