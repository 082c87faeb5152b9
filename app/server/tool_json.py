"""Prefix-safe JSON pieces for streamed tool calls: a call header and a value-end scanner.

Every answer here depends only on the text given, and a "partial" answer never turns into a
different decision once more text arrives, so a streamed parse gives the same calls whatever the
chunking.
"""

import json
from dataclasses import dataclass
from typing import Literal

ARG_KEYS = ('"arguments"', '"parameters"')
_WS = " \t\r\n"

# `{ "name" : <string> , "arguments" :`; None marks the name string.
_HEADER_STEPS: tuple[tuple[str, ...] | None, ...] = (
    ("{",),
    ('"name"',),
    (":",),
    None,
    (",",),
    ARG_KEYS,
    (":",),
)

Verdict = Literal["ok", "partial", "fail"]


@dataclass(frozen=True, slots=True)
class Header:
    """`{"name": "...", "arguments":` read from the start of a text."""

    verdict: Verdict
    name: str = ""
    end: int = 0  # offset just past the ':' before the arguments value


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _literal(s: str, i: int, options: tuple[str, ...]) -> tuple[Verdict, int]:
    for lit in options:
        if s.startswith(lit, i):
            return "ok", i + len(lit)
    rest = s[i:]
    if any(lit.startswith(rest) for lit in options):
        return "partial", i
    return "fail", i


def _string_end(s: str, i: int) -> int | None:
    """Offset past the JSON string starting at s[i] == '"', or None when it is not closed yet."""
    j, esc = i + 1, False
    while j < len(s):
        c = s[j]
        if esc:
            esc = False
        elif c == "\\":
            esc = True
        elif c == '"':
            return j + 1
        j += 1
    return None


def read_header(s: str) -> Header:
    """Parse `{ "name" : "<str>" , "arguments"|"parameters" :` at the start of `s`."""
    i = skip_ws(s, 0)
    name = ""
    for step in _HEADER_STEPS:
        i = skip_ws(s, i)
        if i >= len(s):
            return Header("partial")
        if step is not None:
            verdict, i = _literal(s, i, step)
            if verdict != "ok":
                return Header(verdict)
            continue
        if s[i] != '"':
            return Header("fail")
        end = _string_end(s, i)
        if end is None:
            return Header("partial")
        try:
            name = json.loads(s[i:end])
        except ValueError:
            return Header("fail")
        i = end
    return Header("ok", name, i)


class ValueScanner:
    """Finds where one JSON object or array ends, fed piece by piece (strings and escapes aware)."""

    def __init__(self, depth: int = 0):
        self.depth = depth
        self._in_str = False
        self._esc = False

    def feed(self, s: str) -> int | None:
        """Offset in `s` just past the value's end, or None when `s` is used up first."""
        for j, c in enumerate(s):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return j + 1
        return None


def string_value_end(s: str) -> int | None:
    """For `s` starting with a JSON string: the offset past it, or None while it is open."""
    return _string_end(s, 0)


def calls_from_json(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) for a whole JSON call or list of calls; None when it is not one."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = data if isinstance(data, list) else [data]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters"))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        out.append((item["name"], json.dumps(args, ensure_ascii=False)))
    return out or None
