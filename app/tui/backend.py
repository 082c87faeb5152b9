"""The chat backend seam: what the TUI needs from a model (a protocol) and the data it passes.

Two implementations: `EngineBackend` (the local `AsyncEngine`) and `EndpointBackend` (any
OpenAI-compatible server). Tests use a fake one.
"""

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class GenSettings:
    """Per-conversation generation settings (llama.cpp-like defaults)."""

    system_prompt: str = ""
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    max_tokens: int = 512

    def __post_init__(self):
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: "GenSettings | None" = None) -> "GenSettings":
        """`base` (or the defaults) overridden by the known keys of `data`; unknown keys ignored."""
        known = {f.name for f in fields(cls)}
        values = (base or cls()).to_dict()
        values.update({k: v for k, v in data.items() if k in known})
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """New text of the answer (and of the model's reasoning, from a server that splits it off);
    token counts are cumulative for the request when known."""

    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    reasoning: str = ""


class ChatBackend(Protocol):
    """A model the chat can stream from. `stream` must never block the event loop."""

    name: str
    model_bytes: int  # weight bytes held in this process (0 for a remote endpoint)

    @property
    def max_model_len(self) -> int | None: ...

    def stream(
        self, messages: Sequence[Mapping[str, str]], settings: GenSettings
    ) -> AsyncIterator[ChatDelta]: ...

    async def close(self) -> None: ...


def chat_messages(
    history: Sequence[tuple[str, str]], settings: GenSettings
) -> list[dict[str, str]]:
    """OpenAI-style messages: the system prompt (when set) then `(role, content)` pairs."""
    out = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    out.extend({"role": r, "content": c} for r, c in history)
    return out
