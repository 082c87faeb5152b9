"""Tools into the prompt and into the grammar: what a chat request with `tools` asks of the model.

Templates that know tools get them as the `tools` variable; for the rest (SmolLM2, Gemma, ...) a
system text describes the tools and the call format, as llama-server does, so any model can call
them. History with assistant `tool_calls` and `role: "tool"` results goes through the template when
it handles them, else as text in the family's own format. `required` and named `tool_choice`
become a grammar: the family's call format with each tool's JSON-schema parameters.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localllm.app.server import glm_tools, harmony, lfm2_tools
from localllm.app.server.tool_parsers import GLM, HARMONY, LFM2, LLAMA3, MISTRAL, ToolFormat

_INTRO = (
    "You can call the following tools (JSON schemas of their parameters are given). "
    "To call one, answer with exactly this and nothing else:\n"
)


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What a chat template source handles by itself."""

    tools: bool  # reads the `tools` variable
    tool_calls: bool  # renders assistant `tool_calls`
    tool_role: bool  # renders `role: "tool"` messages

    @classmethod
    def of(cls, source: str | None) -> "TemplateTraits":
        src = source or ""
        has_role = "'tool'" in src or '"tool"' in src or "ipython" in src
        return cls("tools" in src, "tool_calls" in src, has_role)


def _args_key(fmt: ToolFormat) -> str:
    return "parameters" if fmt is LLAMA3 else "arguments"


def call_text(fmt: ToolFormat, calls: Sequence[tuple[str, Any]]) -> str:
    """Calls (name, arguments object) written as the family writes them."""
    if fmt is GLM:
        return glm_tools.call_text(calls)
    if fmt is LFM2:
        return lfm2_tools.call_text(calls)
    key = _args_key(fmt)
    objs = [json.dumps({"name": n, key: a}, ensure_ascii=False) for n, a in calls]
    if fmt is MISTRAL:
        return fmt.trigger + "[" + ", ".join(objs) + "]"
    if fmt is LLAMA3:
        return "; ".join(objs)
    return "\n".join(f"{fmt.trigger}\n{o}\n{fmt.end}" for o in objs)


def tools_system_text(fmt: ToolFormat, tools: Sequence[dict]) -> str:
    """The generic tool description for templates that do not take `tools`."""
    example = call_text(fmt, [("<tool name>", "<arguments as a JSON object>")])
    example = example.replace('"<arguments as a JSON object>"', "<arguments as a JSON object>")
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return f"{_INTRO}{example}\n\nTools:\n{listing}"


def _arguments(raw: Any) -> Any:
    """OpenAI sends arguments as JSON text; templates index them as an object."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _calls_of(msg: dict) -> list[tuple[str, Any]]:
    out = []
    for tc in msg.get("tool_calls") or ():
        fn = tc.get("function") or {}
        out.append((str(fn.get("name", "")), _arguments(fn.get("arguments", "{}"))))
    return out


def prompt_messages(
    messages: list[dict], tools: list[dict] | None, traits: TemplateTraits, fmt: ToolFormat
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render: tools as a template variable or a system text; tool history
    as the template takes it or as text."""
    names = {}  # tool_call_id -> name, to label results in the text form
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            for tc in m["tool_calls"]:
                names[tc.get("id")] = (tc.get("function") or {}).get("name")
            if traits.tool_calls:
                m["tool_calls"] = [_template_call(tc) for tc in m["tool_calls"]]
                m["content"] = m.get("content") or ""
            else:
                text = m.get("content") or ""
                m["content"] = (text + "\n" if text else "") + call_text(fmt, _calls_of(m))
                del m["tool_calls"]
        elif m.get("role") == "tool" and not (traits.tool_role and traits.tool_calls):
            label = names.get(m.get("tool_call_id")) or m.get("name") or "tool"
            m = {"role": "user", "content": f"<tool_response>\n{label}: {m.get('content') or ''}"
                 "\n</tool_response>"}  # fmt: skip
        out.append(m)
    if not tools or traits.tools:
        return out, tools or None
    text = tools_system_text(fmt, tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def _template_call(tc: dict) -> dict:
    fn = dict(tc.get("function") or {})
    fn["arguments"] = _arguments(fn.get("arguments", "{}"))
    return {**tc, "function": fn, "name": fn.get("name"), "arguments": fn["arguments"]}


def call_grammar(
    fmt: ToolFormat,
    tools: Sequence[dict],
    parallel: bool,
    trigger_token: int | None,
    markers: Mapping[str, int] | None = None,
) -> str:
    """A Lark grammar (llguidance) for one call (or several when `parallel`) to one of `tools`.

    `trigger_token`: the id of the family's opening marker when it is a single special token,
    which text cannot spell; `markers`: the same for every marker of a format with several
    (GLM's argument tags).
    """
    if fmt is HARMONY:
        return harmony.call_grammar(list(tools), closed_schema)
    if fmt is GLM:
        return glm_tools.call_grammar(list(tools), parallel, markers or {}, closed_schema)
    key = _args_key(fmt)
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: closed_schema(t["function"].get("parameters") or {"type": "object"}),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"anyOf": options, "x-guidance": {"whitespace_flexible": False}}
    trig = f"<[{trigger_token}]>" if trigger_token is not None else json.dumps(fmt.trigger)
    if fmt is MISTRAL:
        start = f'{trig} "[" call' + (' (", " call)*' if parallel else "") + ' "]"'
    elif fmt is LLAMA3:
        start = "call" + (' ("; " call)*' if parallel else "")
    else:
        block = f'{trig} "\\n" call "\\n" {json.dumps(fmt.end)}'
        start = block + (f' ("\\n" {block})*' if parallel else "")
    return f"start: {start}\ncall: %json {json.dumps(schema)}\n"


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# Not `not` or `if`: closing an object there widens what the whole schema lets through.
_SUBSCHEMAS = ("items", "additionalProperties", "then", "else")
MAX_SCHEMA_DEPTH = 64


def closed_schema(schema: Any, depth: int = 0) -> Any:
    """`schema` with every object that lists `properties` closed to them where it does not say
    otherwise (`additionalProperties: false`), as llama.cpp's grammars read tool parameters:
    JSON Schema's open default let a forced call fill undeclared keys until the token limit.
    `allOf` members stay as given: closing each would forbid the others' properties."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"tools: a function's parameters nest deeper than {MAX_SCHEMA_DEPTH}")
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s, depth + 1) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(s, depth + 1) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key], depth + 1)
    return out


def pick_tools(tools: list[dict], choice: str | dict | None) -> tuple[list[dict], bool]:
    """(the tools a call may use, whether a call is forced) for a `tool_choice`; ValueError when
    it names no given tool."""
    if choice is None or choice == "auto":
        return tools, False
    if choice == "required":
        return tools, True
    if choice == "none":
        return [], False
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names the tool {name!r}, which is not in tools")
        return chosen, True
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}'
    )
