"""Tool calls in generated text (Hermes/Qwen, Llama 3 and Mistral formats), whole or streamed.

gpt-oss's harmony format is detected here too (`HARMONY`); its channels are read by `harmony`;
GLM's XML-ish arguments (`GLM`) are read by `glm_tools`, LFM2's pythonic call lists (`LFM2`) by
`lfm2_tools`.

`ToolCallParser.feed(delta)` turns text pieces into events: content, a call's start (id, name),
then fragments of its arguments JSON. Decisions depend only on the text, never on how it was
split, so streaming and `parse_tool_calls` (the same parser fed once) give the same calls. A block
that opens like a call but is not one (bad JSON, no name) goes back to the content, as text.
"""

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from localllm.app.server.tool_json import (
    Header,
    ValueScanner,
    calls_from_json,
    read_header,
    skip_ws,
    string_value_end,
)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one template family writes calls."""

    name: str
    trigger: str  # text that opens a call block
    end: str | None = None  # text that closes a block (Hermes); None: the block is the JSON
    json_start: bool = False  # an output opening with `{` is a call (Llama 3's JSON calls)
    id_chars: int = 24  # Mistral's templates insist on 9-character ids


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", json_start=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", id_chars=9)
HARMONY = ToolFormat("harmony", "<|channel|>", "<|call|>")  # parsed by `harmony`, not here
GLM = ToolFormat("glm", "<tool_call>", "</tool_call>")  # parsed by `glm_tools`, not here
LFM2 = ToolFormat("lfm2", "<|tool_call_start|>", "<|tool_call_end|>")  # parsed by `lfm2_tools`
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, HARMONY, GLM, LFM2)}


def detect_format(template: str | None) -> ToolFormat:
    """The family a chat template speaks, from its markers; Hermes tags for everything else."""
    src = template or ""
    if "<|channel|>" in src:  # llama.cpp's test for gpt-oss
        return HARMONY
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<arg_key>" in src:  # GLM-4.5 / 4.6 / 4.7 (their templates have <tool_call> too)
        return GLM
    if "<|tool_list_start|>" in src or "<|tool_call_start|>" in src:  # LFM2's markers
        return LFM2
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and '"parameters"' in src):
        return LLAMA3
    return HERMES


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgsDelta


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it


_MISTRAL_NAME = re.compile(r"([\w.\-]+)(?:\[CALL_ID\][\w\-]*)?\[ARGS\]")
_MISTRAL_NAME_PREFIX = re.compile(r"[\w.\-]*(?:\[[\w\-\[\]]*)?")


def new_call_id(fmt: ToolFormat) -> str:
    """A call id as the family's templates take them."""
    h = uuid.uuid4().hex
    return h[: fmt.id_chars] if fmt.id_chars < 24 else "call_" + h[: fmt.id_chars]


class ToolCallParser:
    """Incremental parser of one completion's text."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] | None = None):
        self.fmt = fmt
        self._new_id = new_id or (lambda: new_call_id(fmt))
        self._buf = ""
        self._state = "start" if fmt.json_start else "text"
        self._raw = ""  # text of the current block so far, for the fallback to content
        self._in_array = False
        self._scan: ValueScanner | None = None
        self._string_args = False
        self._name_form = False  # the current call is Mistral's `name[ARGS]{...}`
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """Events for text held back until the end (a partial marker, an undecided block)."""
        return self._run(final=True)

    # -- the state machine: each step consumes text or says it needs more ------------------

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final):
            pass
        return _merged(out)

    def _step(self, out: list[Event], final: bool) -> bool:
        return getattr(self, "_" + self._state)(out, final)

    def _start(self, out: list[Event], final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        if i == len(self._buf) and not final:
            return False
        if self._buf[i : i + 1] == "{":
            self._raw, self._buf = self._buf[:i], self._buf[i:]
            self._state = "header"
        else:
            self._state = "text"
        return True

    def _text(self, out: list[Event], final: bool) -> bool:
        trig = self.fmt.trigger
        i = self._buf.find(trig)
        if i >= 0:
            out.append(ContentDelta(self._buf[:i]))
            self._raw, self._buf = trig, self._buf[i + len(trig) :]
            self._state = "body"
            return True
        keep = 0 if final else _partial_suffix(self._buf, trig)
        emit = self._buf[: len(self._buf) - keep]
        if emit:
            out.append(ContentDelta(emit))
            self._buf = self._buf[len(emit) :]
        return False

    def _body(self, out: list[Event], final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        if i == len(self._buf):
            return self._to_raw() if final else False
        c = self._buf[i]
        self._take(i)
        if c == "{":
            self._state = "header"
        elif c == "[" and self.fmt is MISTRAL:
            self._take(1)
            self._in_array = True
            self._state = "next"
        elif self.fmt is MISTRAL:
            self._state = "mistral_name"
        else:
            return self._to_raw()
        return True

    def _header(self, out: list[Event], final: bool) -> bool:
        h = read_header(self._buf)
        if h.verdict == "ok":
            h = self._args_ahead(h.name, h.end)
        if h.verdict == "partial" and not final:
            return False
        if h.verdict != "ok":
            return self._to_raw()
        self._start_call(out, h.name)
        self._take(h.end)
        self._state = "args"
        return True

    def _args_ahead(self, name: str, end: int) -> Header:
        """A call starts only once its arguments open as an object or a JSON string."""
        j = skip_ws(self._buf, end)
        if j == len(self._buf):
            return Header("partial")
        return Header("ok", name, end) if self._buf[j] in '{"' else Header("fail")

    def _mistral_name(self, out: list[Event], final: bool) -> bool:
        m = _MISTRAL_NAME.match(self._buf)
        h = Header("fail") if m is None else self._args_ahead(m.group(1), m.end())
        if h.verdict != "ok":
            partial = h.verdict == "partial" or (
                m is None and _MISTRAL_NAME_PREFIX.fullmatch(self._buf) is not None
            )
            return False if partial and not final else self._to_raw()
        self._start_call(out, m.group(1))
        self._take(m.end())
        self._state = "args"
        return True

    def _args(self, out: list[Event], final: bool) -> bool:
        if self._scan is None:
            i = skip_ws(self._buf, 0)
            if i == len(self._buf):
                return self._end_block(out) if final else False
            self._take(i)
            self._string_args = self._buf[0] == '"'
            self._scan = ValueScanner()
        if self._string_args:  # arguments as a JSON-encoded string: sent decoded, in one piece
            end = string_value_end(self._buf)
            if end is None:
                return self._end_block(out) if final else False
            out.append(ArgsDelta(len(self.calls) - 1, _decoded(self._buf[:end])))
        else:
            end = self._scan.feed(self._buf)
            piece = self._buf if end is None else self._buf[:end]
            if piece:
                out.append(ArgsDelta(len(self.calls) - 1, piece))
            if end is None:
                self._take(len(self._buf))
                return self._end_block(out) if final else False
        self._take(end)
        self._scan = None
        self._state = "args_done"
        return True

    def _args_done(self, out: list[Event], final: bool) -> bool:
        if self._name_form:
            self._state = "text"
            return True
        if self._scan is None:
            self._scan = ValueScanner(depth=1)  # the rest of the call object (extra keys)
        end = self._scan.feed(self._buf)
        if end is None:
            self._take(len(self._buf))
            return self._end_block(out) if final else False
        self._take(end)
        self._scan = None
        self._state = "after"
        return True

    def _after(self, out: list[Event], final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        rest, end = self._buf[i:], self.fmt.end
        if end is not None:
            if not rest.startswith(end) and end.startswith(rest) and not final:
                return False  # the closing tag may be on its way
            if rest.startswith(end):
                self._take(i + len(end))
            self._state, self._raw = "text", ""
            return True
        if not rest and not final:
            return False
        if self._in_array and rest[:1] in (",", "]"):
            self._take(i + 1)
            self._in_array = rest[0] == ","
            self._state = "next" if self._in_array else "text"
        elif self.fmt is LLAMA3 and rest[:1] in (";", "{"):
            self._take(i + (rest[0] == ";"))
            self._state = "next"
        else:
            self._state = "text"
        self._raw = ""  # a later item that is no call ends the list; it does not undo it
        return True

    def _next(self, out: list[Event], final: bool) -> bool:
        """Between calls of a list: the next object, or the list's end."""
        i = skip_ws(self._buf, 0)
        if i == len(self._buf):
            if final:
                self._state = "text"
                return True
            return False
        first = bool(self._raw)  # no call in this block yet (a call start empties it)
        self._take(i)
        if self._buf[0] == "{":
            self._state = "header"
        elif first:  # the list's first item is no call: the whole block is text
            return self._to_raw()
        elif self._in_array and self._buf[0] == "]":
            self._take(1)
            self._in_array = False
            self._state = "text"
        else:
            self._state = "text"
        return True

    def _raw_block(self, out: list[Event], final: bool) -> bool:
        end = self.fmt.end
        if end is not None and end in self._buf:
            cut = self._buf.index(end)
            body, self._buf = self._buf[:cut], self._buf[cut + len(end) :]
            self._settle_raw(out, body, end)
            return True
        if not final:
            return False
        body, self._buf = self._buf, ""
        self._settle_raw(out, body, "")
        return False

    # -- helpers -----------------------------------------------------------------------------

    def _start_call(self, out: list[Event], name: str) -> None:
        self._name_form = self._state == "mistral_name"
        self._raw = ""  # from here on the block is a call, never text again
        call = ToolCall(self._new_id(), name)
        self.calls.append(call)
        out.append(CallStart(len(self.calls) - 1, call.id, name))

    def _take(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _to_raw(self) -> bool:
        self._state = "raw_block"
        self._buf = self._raw + self._buf
        self._raw = ""
        return True

    def _settle_raw(self, out: list[Event], block: str, end: str) -> None:
        body = block[len(self.fmt.trigger) :] if block.startswith(self.fmt.trigger) else block
        found = calls_from_json(body.strip())
        if found is None:
            out.append(ContentDelta(block + end))
        for name, args in found or ():
            self._start_call(out, name)
            out.append(ArgsDelta(len(self.calls) - 1, args))
        self._state = "text"

    def _end_block(self, out: list[Event]) -> bool:
        """The text ended inside a started call (cut by max_tokens): keep what it has."""
        self._buf = ""
        self._state = "text"
        return False


def _decoded(s: str) -> str:
    try:
        v = json.loads(s)
    except ValueError:
        return s
    return v if isinstance(v, str) else s


def _partial_suffix(s: str, marker: str) -> int:
    """Length of the longest end of `s` that could start `marker`."""
    for n in range(min(len(marker) - 1, len(s)), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent content or argument pieces joined; empty content dropped."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, ContentDelta) and not e.text:
            continue
        prev = out[-1] if out else None
        if isinstance(e, ContentDelta) and isinstance(prev, ContentDelta):
            out[-1] = ContentDelta(prev.text + e.text)
        elif isinstance(e, ArgsDelta) and isinstance(prev, ArgsDelta) and prev.index == e.index:
            out[-1] = ArgsDelta(e.index, prev.text + e.text)
        else:
            out.append(e)
    return out


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    content: str
    calls: list[ToolCall]


def apply_events(events: list[Event], content: list[str], calls: list[ToolCall]) -> None:
    """Fold events into content pieces and calls (the non-stream view)."""
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append(ToolCall(e.id, e.name))
        else:
            calls[e.index].arguments += e.text


def parse_tool_calls(
    text: str, fmt: ToolFormat, new_id: Callable[[], str] | None = None
) -> ParsedCalls:
    """The calls in a whole output, and the text outside them."""
    p = ToolCallParser(fmt, new_id)
    content: list[str] = []
    calls: list[ToolCall] = []
    apply_events(p.feed(text) + p.finish(), content, calls)
    return ParsedCalls("".join(content), calls)
