"""A chat choice (`ChoiceOutput`) in Anthropic's Messages shapes: content blocks, their stream
events, `stop_reason` and `usage`.

Blocks come in the order the model wrote them: `thinking`, `text`, then one `tool_use` per call
(its `input` the parsed arguments). Streamed, a block opens when the kind of output changes:
`text_delta` / `thinking_delta` pieces, and for a call a `tool_use` start (empty input) followed by
`input_json_delta` pieces of its arguments, as Anthropic streams them.
"""

import json
from typing import Any

from localllm.app.server.chat_output import ChoiceOutput
from localllm.app.server.sse_events import Event
from localllm.engine.core.outputs import Usage


def usage(u: Usage, output_tokens: int | None = None) -> dict:
    """Anthropic counts prompt tokens read from the prefix cache apart from `input_tokens`; the
    cache is automatic, so nothing is ever written to it on request (creation is 0)."""
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens if output_tokens is None else output_tokens,
    }


def stop(finish: str | None, stop_reason: int | str | None, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict:
    """A call's arguments as the `input` object; text cut short (max_tokens) is no object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def blocks(co: ChoiceOutput) -> list[dict]:
    out = []
    if co.reasoning:
        out.append({"type": "thinking", "thinking": "".join(co.reasoning), "signature": ""})
    text = "".join(co.content)
    if text or not co.calls:  # an answer of calls alone has no text block
        out.append({"type": "text", "text": text})
    for c in co.calls:
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return out


def _ev(kind: str, **data: Any) -> Event:
    return kind, {"type": kind, **data}


class BlockStream:
    """Content-block events for one choice's deltas (`ChoiceOutput.feed` / `finish`)."""

    def __init__(self):
        self.index, self.kind = -1, None
        self._call = -1  # the index (in the choice's calls) of the open tool_use block

    def add(self, delta: dict) -> list[Event]:
        if delta.get("reasoning_content"):
            return self._piece("thinking", "thinking_delta", "thinking", delta["reasoning_content"])
        if delta.get("content"):
            return self._piece("text", "text_delta", "text", delta["content"])
        out = []
        for tc in delta.get("tool_calls") or ():
            if tc.get("id"):  # a call starts: its name and id come first, arguments after
                out += self._open("tool_use", id=tc["id"], name=tc["function"]["name"], input={})
                self._call = tc["index"]
            args = tc["function"].get("arguments")
            if args and tc["index"] == self._call:
                delta = {"type": "input_json_delta", "partial_json": args}
                out.append(_ev("content_block_delta", index=self.index, delta=delta))
        return out

    def close(self) -> list[Event]:
        out = self._open("text", text="") if self.kind is None else []  # empty: one empty block
        return [*out, _ev("content_block_stop", index=self.index)]

    def _piece(self, kind: str, delta_type: str, field: str, text: str) -> list[Event]:
        out = []
        if kind != self.kind:
            extra = {"signature": ""} if kind == "thinking" else {}
            out = self._open(kind, **{field: ""}, **extra)
        delta = {"type": delta_type, field: text}
        return [*out, _ev("content_block_delta", index=self.index, delta=delta)]

    def _open(self, kind: str, **block: Any) -> list[Event]:
        first = self.kind is None
        out = [] if first else [_ev("content_block_stop", index=self.index)]
        self.index, self.kind = self.index + 1, kind
        out.append(_ev("content_block_start", index=self.index,
                       content_block={"type": kind, **block}))  # fmt: skip
        if first:
            out.append(_ev("ping"))
        return out
