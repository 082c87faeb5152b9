"""One chat choice's text turned into OpenAI message parts: reasoning, content, tool calls.

The same object serves both shapes: `feed`/`finish` give stream deltas, and `message()` the whole
assistant message built from those very deltas, so streamed and non-streamed answers agree.
gpt-oss's harmony output (channels, not tags) is read by `harmony` instead: when the plan says so,
or else when the output opens with a harmony header, as a `<think>` block is recognised.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localllm.app.server.glm_tools import GlmToolParser
from localllm.app.server.harmony import HarmonyParser, ReasoningDelta, opens_harmony
from localllm.app.server.lfm2_tools import Lfm2ToolParser
from localllm.app.server.reasoning import ReasoningParser
from localllm.app.server.tool_parsers import (
    GLM,
    HARMONY,
    LFM2,
    ArgsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCall,
    ToolCallParser,
    ToolFormat,
)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How a request's output is read."""

    reasoning: bool = False  # split `<think>` blocks off as reasoning_content
    in_think: bool = False  # the prompt left a think block open
    tools: ToolFormat | None = None  # parse tool calls in this family's format
    # the offered tools' parameter schemas by name (GLM's values are typed by them)
    tool_params: Mapping[str, Any] = field(default_factory=dict)
    harmony: bool = False  # the template is gpt-oss's harmony (whether or not tools are on)


class ChoiceOutput:
    def __init__(self, plan: OutputPlan):
        self._think = ReasoningParser(plan.in_think) if plan.reasoning else None
        harmony = plan.harmony or plan.tools is HARMONY
        self._tools = ToolCallParser(plan.tools) if plan.tools and not harmony else None
        if plan.tools is GLM:
            self._tools = GlmToolParser(plan.tool_params)
        if plan.tools is LFM2:
            self._tools = Lfm2ToolParser()
        self._plan = plan
        self._harmony = self._new_harmony() if harmony else None
        # Without tools the plan may not know the template: the output's opening tells.
        self._sniff = "" if self._harmony is None and self._tools is None else None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def _new_harmony(self) -> HarmonyParser:
        return HarmonyParser(self._plan.tools is not None, self._plan.reasoning)

    def feed(self, text: str) -> list[dict]:
        return self._deltas(text, final=False)

    def finish(self) -> list[dict]:
        return self._deltas("", final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        if reason is None:
            return None
        if reason == "abort":
            return "stop"
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _deltas(self, text: str, final: bool) -> list[dict]:
        if self._sniff is not None:
            text, self._sniff = self._sniff + text, ""
            verdict = opens_harmony(text)
            if verdict is None and not final:
                self._sniff = text  # a harmony header may be on its way
                return []
            self._sniff = None
            if verdict:
                self._harmony = self._new_harmony()
        if self._harmony is not None:
            events = self._harmony.feed(text) if text else []
            return [self._event(e) for e in events + (self._harmony.finish() if final else [])]
        out: list[dict] = []
        if self._think is not None:
            parts = [self._think.feed(text)] + ([self._think.finish()] if final else [])
            reasoning = "".join(p.reasoning for p in parts)
            text = "".join(p.content for p in parts)
            if reasoning:
                self.reasoning.append(reasoning)
                out.append({"reasoning_content": reasoning})
        if self._tools is None:
            if text:
                self.content.append(text)
                out.append({"content": text})
            return out
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish()
        out += [self._event(e) for e in events]
        return out

    def _event(self, e: Event | ReasoningDelta) -> dict:
        if isinstance(e, ReasoningDelta):
            self.reasoning.append(e.text)
            return {"reasoning_content": e.text}
        if isinstance(e, ContentDelta):
            self.content.append(e.text)
            return {"content": e.text}
        if isinstance(e, CallStart):
            self.calls.append(ToolCall(e.id, e.name))
            fn = {"name": e.name, "arguments": ""}
            return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                    "function": fn}]}  # fmt: skip
        assert isinstance(e, ArgsDelta)
        self.calls[e.index].arguments += e.text
        return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}

    def message(self) -> dict:
        """The whole assistant message (after `finish`)."""
        content = "".join(self.content)
        msg: dict = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["content"] = content if content.strip() else None
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]  # fmt: skip
        return msg
