"""LFM2's tool calls: Liquid's pythonic call list between two control tokens, parsed whole or
streamed, and written back as text for the history.

    <|tool_call_start|>[get_weather(city="Paris", days=2), get_time()]<|tool_call_end|>

The block is a Python list of calls with keyword arguments of literal values (strings, numbers,
True / False / None, lists, dicts), read with `ast` and `ast.literal_eval` (never evaluated).
JSON between the markers is read too: LFM2 writes it when its system prompt asks, and a forced
`tool_choice` grammar (`tool_prompt.call_grammar`) writes `{"name": ..., "arguments": {...}}`.
A block is decided once it closes, or at the end of the text (the model may stop after the list):
its calls, or, when it holds none, its text back to the content. The events are
`tool_parsers`' (content, a call's start, its arguments JSON in one piece).
"""

import ast
import json
from collections.abc import Callable, Sequence
from typing import Any

from localllm.app.server.tool_json import calls_from_json
from localllm.app.server.tool_parsers import (
    LFM2,
    ArgsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCall,
    _merged,
    _partial_suffix,
    new_call_id,
)

OPEN, CLOSE = LFM2.trigger, LFM2.end


def parse_block(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a block's text, or None when it is no call list."""
    body = body.strip()
    found = calls_from_json(body) if body[:1] in "{[" else None
    return found if found is not None else _pythonic(body)


def _pythonic(body: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    out = []
    for call in items:
        name = _dotted(call.func) if isinstance(call, ast.Call) else None
        if name is None or call.args or any(kw.arg is None for kw in call.keywords):
            return None  # positional or **kwargs arguments: not a call LFM2 writes
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            out.append((name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None  # a value that is no literal, or none JSON can hold (a set, bytes)
    return out or None


def _dotted(node: ast.expr) -> str | None:
    """`name` or `a.b.name` (a function name as a template may list it)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def call_text(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls (name, arguments object) as LFM2 writes them (its template renders no tool_calls:
    the history carries them as this text)."""
    parts = []
    for name, args in calls:
        if isinstance(args, dict):
            parts.append(f"{name}({', '.join(f'{k}={_py(v)}' for k, v in args.items())})")
        else:  # arguments that are no object: the JSON form, which the parser reads back
            return OPEN + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + CLOSE
    return OPEN + "[" + ", ".join(parts) + "]" + CLOSE


def _py(v: Any) -> str:
    """A JSON value as a Python literal."""
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_py(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_py(x)}" for k, x in v.items()) + "}"
    return json.dumps(v, ensure_ascii=False)


class Lfm2ToolParser:
    """Incremental parser of one completion's text (the interface of `ToolCallParser`)."""

    def __init__(self, new_id: Callable[[], str] | None = None):
        self.fmt = LFM2
        self._new_id = new_id or (lambda: new_call_id(LFM2))
        self._buf = ""
        self._in_block = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """Events for text held back until the end (a partial marker, an open block)."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._block(out, final) if self._in_block else self._text(out, final):
            pass
        return _merged(out)

    def _text(self, out: list[Event], final: bool) -> bool:
        i = self._buf.find(OPEN)
        if i >= 0:
            out.append(ContentDelta(self._buf[:i]))
            self._buf, self._in_block = self._buf[i + len(OPEN) :], True
            return True
        keep = 0 if final else _partial_suffix(self._buf, OPEN)
        out.append(ContentDelta(self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _block(self, out: list[Event], final: bool) -> bool:
        end = self._buf.find(CLOSE)
        if end < 0 and not final:
            return False
        body = self._buf if end < 0 else self._buf[:end]
        rest = "" if end < 0 else self._buf[end + len(CLOSE) :]
        found = parse_block(body)
        if found is None:  # no call after all: the block is text
            out.append(ContentDelta(OPEN + body + ("" if end < 0 else CLOSE)))
        for name, args in found or ():
            self.calls.append(ToolCall(self._new_id(), name))
            out.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))
            out.append(ArgsDelta(len(self.calls) - 1, args))
        self._buf, self._in_block = rest, False
        return bool(rest)
