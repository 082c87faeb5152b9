"""The output items of one Responses answer, built from a chat choice's deltas, and their events.

Items come in the order the model wrote them: a `reasoning` item (its text as `reasoning_text`)
for each stretch of reasoning, a `message` item (one `output_text` part) for each stretch of
answer. Streamed, an item opens when the kind of output changes (`output_item.added`, for a
message also `content_part.added`), its text follows as `reasoning_text.delta` /
`output_text.delta`, and it closes with the matching `.done` events; the final response lists the
very same items, ids included, as the SDKs' stream helpers check. Ids are OpenAI's shapes:
`resp_`, `msg_` and `rs_` followed by 48 hex digits.
"""

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

Emit = Callable[..., tuple[str, dict]]  # (event type, **fields) -> a numbered event


def typed_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(slots=True)
class _Item:
    kind: str  # "reasoning" or "message"
    id: str
    texts: list[str] = field(default_factory=list)

    def shape(self, status: str, whole: bool = True) -> dict:
        text = "".join(self.texts)
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if whole else []
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content,
                    "status": status}  # fmt: skip
        return {"type": "message", "id": self.id, "status": status, "role": "assistant",
                "content": [_part(text)] if whole else []}  # fmt: skip


class OutputItems:
    """One response's items; `add` takes a `ChoiceOutput` delta and gives the stream events."""

    def __init__(self, emit: Emit):
        self._emit = emit
        self.items: list[_Item] = []

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        out = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            text = delta.get(key)
            if not text:
                continue
            if not self.items or self.items[-1].kind != kind:
                out += self._close() + self._open(kind)
            item = self.items[-1]
            item.texts.append(text)
            kind_delta = "response.reasoning_text.delta" if kind == "reasoning" else (
                "response.output_text.delta")  # fmt: skip
            extra = {} if kind == "reasoning" else {"logprobs": []}
            out.append(self._emit(kind_delta, **self._at(), delta=text, **extra))
        return out

    def close(self) -> list[tuple[str, dict]]:
        """The last item's closing events; an answer with no text still has its (empty)
        message."""
        out = []
        if not any(i.kind == "message" for i in self.items):
            out = self._close() + self._open("message")
        return out + self._close()

    def output(self, status: str) -> list[dict]:
        items = self.items
        if not any(i.kind == "message" for i in items):
            items = [*items, _Item("message", typed_id("msg"))]
        return [i.shape(status) for i in items]

    def _at(self) -> dict:
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1,
                "content_index": 0}  # fmt: skip

    def _open(self, kind: str) -> list[tuple[str, dict]]:
        item = _Item(kind, typed_id("rs" if kind == "reasoning" else "msg"))
        self.items.append(item)
        index = len(self.items) - 1
        out = [self._emit("response.output_item.added", output_index=index,
                          item=item.shape("in_progress", whole=False))]  # fmt: skip
        if kind == "message":
            out.append(self._emit("response.content_part.added", **self._at(), part=_part("")))
        return out

    def _close(self) -> list[tuple[str, dict]]:
        if not self.items:
            return []
        item, at = self.items[-1], self._at()
        text = "".join(item.texts)
        if item.kind == "reasoning":
            out = [self._emit("response.reasoning_text.done", **at, text=text)]
        else:
            out = [self._emit("response.output_text.done", **at, text=text, logprobs=[]),
                   self._emit("response.content_part.done", **at, part=_part(text))]  # fmt: skip
        done = item.shape("completed")
        out.append(self._emit("response.output_item.done", output_index=at["output_index"],
                              item=done))  # fmt: skip
        return out
