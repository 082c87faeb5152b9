"""gpt-oss's harmony output: channels into reasoning, content and tool calls, whole or streamed.

After the prompt's `<|start|>assistant` the model writes messages, each a header, `<|message|>`,
a body and `<|end|>` (the last ends at `<|call|>` or `<|return|>`, end-of-generation tokens
that are not in the text):

    <|channel|>analysis<|message|>...<|end|>                                 reasoning
    <|start|>assistant<|channel|>commentary<|message|>...<|end|>             content (preamble)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{..}   (same call)
    <|start|>assistant<|channel|>final<|message|>...                         content

A recipient may sit in the role or the channel part of the header (openai/harmony's docs;
llama.cpp's common/chat.cpp takes both). Messages to other recipients (the built-in `browser`
and `python` tools) and calls when the request has no tools are dropped, as llama.cpp does.
Decisions depend only on the text, never on where it was cut, so a stream and the whole text
give the same events.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from localllm.app.server.tool_parsers import (
    HARMONY,
    ArgsDelta,
    CallStart,
    ContentDelta,
    ToolCall,
    new_call_id,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
ROLE_RECIPIENT = " to="  # a call's recipient right after the prompt's `<|start|>assistant`
MAX_HEADER = 512  # characters before `<|message|>`; longer is no header, the text is content

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


Event = ContentDelta | ReasoningDelta | CallStart | ArgsDelta


def opens_harmony(text: str) -> bool | None:
    """Does an output starting with `text` speak harmony? None while it cannot tell yet."""
    head = text.lstrip()
    if text.startswith(ROLE_RECIPIENT) or head.startswith((START, CHANNEL)):
        return True
    if ROLE_RECIPIENT.startswith(text) or any(o.startswith(head) for o in (START, CHANNEL)):
        return None
    return False


class HarmonyParser:
    """Incremental parser of one completion's harmony text.

    tools: turn `functions.*` messages into calls (else they are dropped).
    reasoning: analysis messages are reasoning; when False they stay in the content, tags and
    all, as `--reasoning-format none` keeps `<think>` blocks.
    """

    def __init__(
        self, tools: bool, reasoning: bool = True, new_id: Callable[[], str] | None = None
    ):
        self._tools, self._reasoning = tools, reasoning
        self._new_id = new_id or (lambda: new_call_id(HARMONY))
        self._buf = ""
        self._state = "header"
        self._kind = ""  # of the current body: reasoning / content / call / raw / drop
        self._lead = True  # a call's arguments have not started yet (leading blanks are dropped)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._header(out, final) if self._state == "header" else self._body(out, final):
            pass
        return _merged(out)

    def _header(self, out: list[Event], final: bool) -> bool:
        opening = opens_harmony(self._buf)
        head = self._buf if self._buf.startswith(ROLE_RECIPIENT) else self._buf.lstrip()
        if not head:
            return False
        i = head.find(MESSAGE)
        if opening is False or i > MAX_HEADER or (i < 0 and len(head) > MAX_HEADER + len(MESSAGE)):
            self._state, self._kind = "body", "text"  # not harmony: the rest is plain content
            return True
        if i < 0:
            return False  # the header is still coming (a cut-off one at the end is dropped)
        header, self._buf = head[:i], head[i + len(MESSAGE) :]
        self._kind = self._classify(header)
        self._state, self._lead = "body", True
        if self._kind == "raw":
            out.append(ContentDelta(header + MESSAGE))
        elif self._kind == "call":
            name = _RECIPIENT.search(header).group(1).removeprefix("functions.")
            self.calls.append(ToolCall(self._new_id(), name))
            out.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))
        return True

    def _classify(self, header: str) -> str:
        header = header.removeprefix(START)
        role = header.split(CHANNEL, 1)[0].split()
        if role and role[0] != "assistant" and not role[0].startswith("to="):
            return "drop"  # a message in another role's name (a made-up tool result)
        recipient = next((r for r in _RECIPIENT.findall(header) if r != "assistant"), None)
        channels = _CHANNEL.findall(header)
        if recipient is not None:
            return "call" if self._tools and recipient.startswith("functions.") else "drop"
        if channels and channels[-1] == "analysis":
            return "reasoning" if self._reasoning else "raw"
        return "content"

    def _body(self, out: list[Event], final: bool) -> bool:
        if self._kind == "text":
            out.append(ContentDelta(self._buf))
            self._buf = ""
            return False
        hits = [(j, e) for e in ENDS if (j := self._buf.find(e)) >= 0]
        if hits:
            j, end = min(hits)
            self._emit(out, self._buf[:j] + (end if self._kind == "raw" else ""))
            self._buf, self._state = self._buf[j + len(end) :], "header"
            return True
        keep = 0 if final else max(_partial_suffix(self._buf, e) for e in ENDS)
        self._emit(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _emit(self, out: list[Event], text: str) -> None:
        if self._kind == "call" and self._lead:
            text = text.lstrip()
            self._lead = not text
        if not text or self._kind == "drop":
            return
        if self._kind == "reasoning":
            out.append(ReasoningDelta(text))
        elif self._kind == "call":
            self.calls[-1].arguments += text
            out.append(ArgsDelta(len(self.calls) - 1, text))
        else:
            out.append(ContentDelta(text))


def call_grammar(tools: list[dict], close: Callable[[dict], dict] = lambda s: s) -> str:
    """A Lark grammar (llguidance) for one harmony call to one of `tools`: the channel header
    with the recipient, then the arguments as JSON of the tool's parameters (through `close`,
    the other formats' schema rule). The call ends the turn (`<|call|>` is an end-of-generation
    token), so there is one call per answer. The markers are special tokens, named as such."""
    rules, alts = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        params = close(fn.get("parameters") or {"type": "object"})
        schema = {**params, "x-guidance": {"whitespace_flexible": False}}
        head = json.dumps(f"commentary to=functions.{fn['name']} ")
        rules.append(
            f'call{i}: {CHANNEL} {head} {CONSTRAIN} "json" {MESSAGE} args{i}\n'
            f"args{i}: %json {json.dumps(schema)}\n"
        )
        alts.append(f"call{i}")
    return f"start: {' | '.join(alts)}\n" + "".join(rules)


def _partial_suffix(s: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(s)), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent pieces of the same kind joined."""
    out: list[Event] = []
    for e in events:
        prev = out[-1] if out else None
        if type(e) is type(prev) and isinstance(e, ContentDelta | ReasoningDelta):
            out[-1] = type(e)(prev.text + e.text)
        elif isinstance(e, ArgsDelta) and isinstance(prev, ArgsDelta) and prev.index == e.index:
            out[-1] = ArgsDelta(e.index, prev.text + e.text)
        else:
            out.append(e)
    return out
