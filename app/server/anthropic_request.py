"""An Anthropic Messages request in the chat path's terms: chat messages and a `ToolRequest`.

System text and text blocks become message text; tool definitions `{name, description,
input_schema}` become OpenAI function tools and `tool_choice` `{type: auto|any|tool|none}` the chat
path's choice, so prompting, grammars and parsing are the chat path's own. In the history an
assistant's `tool_use` blocks become its `tool_calls` (`thinking` its `reasoning_content`), and a
user's `tool_result` blocks become `role: "tool"` messages ahead of the user's text, as Anthropic
puts them first. A user's `image` blocks (`source` base64 with a media type, or url) become the
chat path's image parts; anything else (documents, images elsewhere, server tools) is a 400,
never dropped.
"""

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from localllm.app.server.chat_prep import ToolRequest
from localllm.engine.sampling.params import SamplingParams

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # Anthropic's rule (64) with room; no dots
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's list


class AnthropicMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]]


class MessagesBody(BaseModel):
    """What /v1/messages/count_tokens takes: the prompt side of a Messages request."""

    model_config = ConfigDict(extra="allow")  # metadata, service_tier, thinking, ... accepted

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict]:
        out = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role == "user":
                out += _user(m.content, where)
            elif m.role == "assistant":
                out.append(_assistant(m.content, where))
            else:
                raise ValueError(f"{where}: role must be 'user' or 'assistant', not {m.role!r}")
        return out

    def tool_request(self) -> ToolRequest | None:
        if self.tools is None and self.tool_choice is None:
            return None
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools or ())]
        choice, parallel = _choice(self.tool_choice)
        return ToolRequest(tools, choice, parallel)


class MessagesRequest(MessagesBody):
    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences or ()),
            max_tokens=self.max_tokens,
        )


def _text(content: str | list, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"{where}[{j}]: content blocks of type {kind!r} are not supported")
        if not isinstance(block.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(block["text"])
    return "".join(texts)


def _user(content: str | list[dict], where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, parts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "image":
            parts.append({"type": "image", "url": _image_url(block.get("source"), at)})
            continue
        if not isinstance(block, dict) or block.get("type") != "tool_result":
            parts.append({"type": "text", "text": _text([block], f"{where}.content")})
            continue
        use_id = block.get("tool_use_id")
        if not isinstance(use_id, str) or not use_id:
            raise ValueError(f"{at}.tool_use_id must be a non-empty string")
        result = block.get("content") or ""
        results.append({"role": "tool", "tool_call_id": use_id,
                        "content": _text(result, f"{at}.content")})  # fmt: skip
    if any(p["type"] == "image" for p in parts):
        results.append({"role": "user", "content": parts})
    elif parts or not results:
        results.append({"role": "user", "content": "".join(p["text"] for p in parts)})
    return results


def _image_url(source: Any, where: str) -> str:
    """An image block's source as a URL the chat path loads (base64 data as a data: URL)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _IMAGE_TYPES:
            raise ValueError(f"{where}.source.media_type must be one of {', '.join(_IMAGE_TYPES)}")
        if not isinstance(data, str) or not data:
            raise ValueError(f"{where}.source.data must be the image's base64 text")
        return f"data:{media};base64,{data}"
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}.source.url must be a URL")
        return url
    raise ValueError(f"{where}.source.type must be 'base64' or 'url', not {kind!r}")


def _assistant(content: str | list[dict], where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls, thinking = [], [], []
    for j, block in enumerate(content):
        at, kind = f"{where}.content[{j}]", block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError(f"{at}: a tool_use block needs a name and an input object")
            fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
            calls.append({"id": str(block.get("id") or ""), "type": "function", "function": fn})
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind != "redacted_thinking":  # encrypted: nothing a local template can read
            texts.append(_text([block], f"{where}.content"))
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def _tool(t: dict, where: str) -> dict:
    """An Anthropic tool definition as an OpenAI function tool."""
    if not isinstance(t, dict):
        raise ValueError(f"{where} must be an object")
    kind = t.get("type")
    if kind not in (None, "custom"):
        raise ValueError(f"{where}: server tools ({kind!r}) are not supported; define the tool "
                         "with name, description and input_schema")  # fmt: skip
    name, schema = t.get("name"), t.get("input_schema")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"{where}.name must match [a-zA-Z0-9_-]{{1,128}}, not {name!r}")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.input_schema must be a JSON schema object")
    desc = t.get("description") or ""
    if not isinstance(desc, str):
        raise ValueError(f"{where}.description must be a string")
    # Templates index `description` (gpt-oss's writes "// " + description): always present.
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": schema}}  # fmt: skip


def _choice(choice: dict | None) -> tuple[str | dict | None, bool]:
    """(the chat path's tool_choice, several calls allowed in a forced answer)."""
    if choice is None:
        return None, False
    kind = choice.get("type")
    # One call per forced answer, as on /v1/chat/completions, unless the client says otherwise.
    parallel = choice.get("disable_parallel_tool_use") is False
    if kind in _CHOICES:
        return _CHOICES[kind], parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise ValueError("tool_choice: type 'tool' needs the tool's name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise ValueError("tool_choice.type must be 'auto', 'any', 'tool' or 'none'")
