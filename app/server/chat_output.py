"""One chat choice's text turned into OpenAI message parts: reasoning, content, tool calls.

The same object serves both shapes: `feed`/`finish` give stream deltas, and `message()` the whole
assistant message built from those very deltas, so streamed and non-streamed answers agree.
"""

from dataclasses import dataclass

from localllm.app.server.reasoning import ReasoningParser
from localllm.app.server.tool_parsers import (
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


class ChoiceOutput:
    def __init__(self, plan: OutputPlan):
        self._think = ReasoningParser(plan.in_think) if plan.reasoning else None
        self._tools = ToolCallParser(plan.tools) if plan.tools is not None else None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

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

    def _event(self, e: Event) -> dict:
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
