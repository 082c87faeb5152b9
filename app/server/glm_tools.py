"""GLM-4.5 / 4.6 / 4.7 tool calls: the XML-ish format their chat templates teach, parsed whole or
streamed, written back as text, and forced by a grammar.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>2</arg_value>
    </tool_call>

(GLM-4.7 leaves out the newlines; any whitespace between the parts is accepted.) A value is the
text between its tags: strings as they are, other values as JSON (the templates write
`v | tojson if v is not string else v`). Where that is ambiguous the tool's JSON schema decides: a
parameter declared a string keeps "42" as text; without one, text that parses as a JSON number,
boolean, null, array or object is that value. The events are `tool_parsers`' (content, a call's
start, pieces of its arguments object), the arguments sent one whole key-value pair at a time:
where the text is cut never changes the result. A block that is no call goes back to the content.
"""

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from localllm.app.server.tool_json import calls_from_json, skip_ws
from localllm.app.server.tool_parsers import (
    GLM,
    ArgsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCall,
    _merged,
    _partial_suffix,
    new_call_id,
)

OPEN, CLOSE = GLM.trigger, GLM.end
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
MARKERS = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)  # single tokens in GLM's vocabulary
_NAME = re.compile(r"[^\s<>{}\[\]\"',]+")  # a function name: one run, no spaces or markup
_LEAD = re.compile(r"\s*(?:[^\s<>{}\[\]\"',]+\s*)?")  # what may come before the first tag


class GlmToolParser:
    """Incremental parser of one completion's text (the interface of `ToolCallParser`).

    `params`: each offered tool's name -> its parameters' JSON schema, for typing values."""

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        new_id: Callable[[], str] | None = None,
    ):
        self.fmt = GLM
        self._params = params or {}
        self._new_id = new_id or (lambda: new_call_id(GLM))
        self._buf = ""
        self._state = "text"
        self._pairs = 0  # key-value pairs sent for the current call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """Events for text held back until the end (a partial tag, an undecided block)."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while getattr(self, "_" + self._state)(out, final):
            pass
        return _merged(out)

    def _text(self, out: list[Event], final: bool) -> bool:
        i = self._buf.find(OPEN)
        if i >= 0:
            out.append(ContentDelta(self._buf[:i]))
            self._buf, self._state = self._buf[i + len(OPEN) :], "name"
            return True
        keep = 0 if final else _partial_suffix(self._buf, OPEN)
        emit = self._buf[: len(self._buf) - keep]
        if emit:
            out.append(ContentDelta(emit))
            self._buf = self._buf[len(emit) :]
        return False

    def _name(self, out: list[Event], final: bool) -> bool:
        """After `<tool_call>`: the name, up to the first argument or the block's end."""
        if self._buf.lstrip().startswith("{"):  # a JSON call in GLM's tags (Hermes' body)
            return self._json_body(out, final)
        at = _LEAD.match(self._buf).end()
        rest = self._buf[at:]
        if not rest or (not final and rest[0] == "<" and _partial_tag(rest)):
            return self._to_content(out) if final else False
        name = self._buf[:at].strip()
        if not (rest.startswith((KEY, CLOSE)) and _NAME.fullmatch(name)):
            return self._to_content(out)
        call = ToolCall(self._new_id(), name)
        self.calls.append(call)
        out.append(CallStart(len(self.calls) - 1, call.id, name))
        self._buf, self._state, self._pairs = rest, "args", 0
        return True

    def _json_body(self, out: list[Event], final: bool) -> bool:
        end = self._buf.find(CLOSE)
        if end < 0:
            return self._to_content(out) if final else False
        found = calls_from_json(self._buf[:end].strip())
        if found is None:
            return self._to_content(out)
        for name, args in found:
            call = ToolCall(self._new_id(), name)
            self.calls.append(call)
            out.append(CallStart(len(self.calls) - 1, call.id, name))
            out.append(ArgsDelta(len(self.calls) - 1, args))
        self._buf, self._state = self._buf[end + len(CLOSE) :], "text"
        return True

    def _args(self, out: list[Event], final: bool) -> bool:
        """Inside a started call: key-value pairs until `</tool_call>` (other text skipped)."""
        i = skip_ws(self._buf, 0)
        rest = self._buf[i:]
        if rest.startswith(CLOSE):
            self._close_args(out)
            self._buf, self._state = rest[len(CLOSE) :], "text"
            return True
        if rest.startswith(KEY):
            pair = _pair(rest)
            if pair is None:  # incomplete: more text may finish it
                return self._cut(out) if final else False
            key, value, used = pair
            if key is not None:
                self._send(out, key, value)
            self._buf = rest[used:]
            return True
        if not rest or (rest[0] == "<" and _partial_tag(rest)):
            return self._cut(out) if final else False
        nxt = rest.find("<", 1)  # not a tag: skip to the next one
        if nxt < 0:
            self._buf = ""
            return self._cut(out) if final else False
        self._buf = rest[nxt:]
        return True

    def _send(self, out: list[Event], key: str, raw: str) -> None:
        schema = self._params.get(self.calls[-1].name) or {}
        prop = (schema.get("properties") or {}).get(key) if isinstance(schema, Mapping) else None
        value = typed_value(raw, prop if isinstance(prop, Mapping) else None)
        piece = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        out.append(ArgsDelta(len(self.calls) - 1, ("{" if not self._pairs else ", ") + piece))
        self._pairs += 1

    def _close_args(self, out: list[Event]) -> None:
        out.append(ArgsDelta(len(self.calls) - 1, "}" if self._pairs else "{}"))

    def _cut(self, out: list[Event]) -> bool:
        """The text ended inside a started call (max_tokens): keep the whole pairs it has."""
        self._close_args(out)
        self._buf, self._state = "", "text"
        return False

    def _to_content(self, out: list[Event]) -> bool:
        """No call after all: `<tool_call>` is text, and the rest is read as text again."""
        out.append(ContentDelta(OPEN))
        self._state = "text"
        return True


def _partial_tag(s: str) -> bool:
    """Whether `s` (starting with `<`) may still become one of the tags a call is made of."""
    return any(t.startswith(s) for t in (KEY, CLOSE))


def _pair(s: str) -> tuple[str | None, str, int] | None:
    """(key, raw value, characters used) of the pair `s` starts with, None while it is not
    complete; a key without a value is skipped (key None)."""
    k = s.find(KEY_END, len(KEY))
    if k < 0:
        return None
    key = s[len(KEY) : k].strip()
    v = skip_ws(s, k + len(KEY_END))
    if not s.startswith(VALUE, v):
        if len(s) - v < len(VALUE) and VALUE.startswith(s[v:]):
            return None
        return None, "", k + len(KEY_END)
    e = s.find(VALUE_END, v + len(VALUE))
    if e < 0:
        return None
    return key, s[v + len(VALUE) : e], e + len(VALUE_END)


def typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A value's text as the call's argument: text for string parameters, else its JSON."""
    types = schema.get("type") if schema else None
    types = {types} if isinstance(types, str) else set(types or ())
    if types == {"string"} or (schema and "enum" in schema and raw in schema["enum"]):
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, str):  # a string that happens to be written in quotes
        return raw
    if "string" in types and _json_type(value) not in types:
        return raw
    return value


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return "array" if isinstance(v, list) else "object"


def call_text(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls (name, arguments object) written as GLM's template writes them."""
    blocks = []
    for name, args in calls:
        pairs = args.items() if isinstance(args, Mapping) else [("<name>", "<value>")]
        body = "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{_text(v)}{VALUE_END}\n" for k, v in pairs)
        blocks.append(f"{OPEN}{name}\n{body}{CLOSE}")
    return "\n".join(blocks)


def _text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def call_grammar(
    tools: Sequence[dict],
    parallel: bool,
    markers: Mapping[str, int],
    close: Callable[[dict], dict] = lambda s: s,
) -> str:
    """A Lark grammar (llguidance) for one call (several when `parallel`) to one of `tools` in
    GLM's format: required parameters in schema order, then the optional ones, each at most once;
    string values as raw text (an enum: one of its values; `maxLength` bounds it), other values
    as JSON of their schema (through `close`, the other formats' schema rule). `markers`: the tags
    that are single tokens, by id (user-defined tokens like `<arg_key>` are never text to
    llguidance)."""

    def tag(text: str) -> str:
        return f"<[{markers[text]}]>" if text in markers else json.dumps(text)

    rules, alts = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        params = close(fn.get("parameters") or {"type": "object"})
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        order = [k for k in props if k in required] + [k for k in props if k not in required]
        parts = []
        for j, key in enumerate(order):
            value = _value_rule(f"v{i}_{j}", props[key] or {}, rules)
            head = f'{tag(KEY)} {json.dumps(key)} {tag(KEY_END)} "\\n" {tag(VALUE)}'
            rules.append(f'p{i}_{j}: {head} {value} {tag(VALUE_END)} "\\n"')
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        name = json.dumps(fn["name"] + "\n")
        rules.append(f"call{i}: {tag(OPEN)} {name} {' '.join(parts)} {tag(CLOSE)}")
        alts.append(f"call{i}")
    start = "call" + (' ("\\n" call)*' if parallel else "")
    return f"start: {start}\ncall: {' | '.join(alts)}\n" + "\n".join(rules) + "\n"


def _value_rule(name: str, schema: dict, rules: list[str]) -> str:
    """The rule for one parameter's value text (raw for strings, JSON otherwise)."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(json.dumps(e) for e in enum) + ")"
    if schema.get("type") == "string":
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        span = f"{{{lo},{int(hi)}}}" if hi is not None else ("+" if lo else "*")
        rules.append(f"{name.upper()}: /[^<]{span}/")
        return name.upper()
    strict = {**schema, "x-guidance": {"whitespace_flexible": False}}
    rules.append(f"{name}: %json {json.dumps(strict)}")
    return name
