"""Generation figures for the status line: tokens/s since the first token and context usage."""

import time
from dataclasses import dataclass, field

from localllm.app.tui.backend import ChatDelta


@dataclass
class GenStats:
    """Running figures of one generation (owned by the chat screen, one per answer)."""

    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def update(self, delta: ChatDelta, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if delta.prompt_tokens is not None:
            self.prompt_tokens = delta.prompt_tokens
        if delta.completion_tokens is not None:
            self.completion_tokens = delta.completion_tokens
        elif delta.text or delta.reasoning:
            self.completion_tokens += 1  # a server without usage sends about one token per chunk
        if delta.text or delta.reasoning or delta.completion_tokens:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time since the first."""
        if self.first_token is None or self.last_token is None or self.completion_tokens < 2:
            return None
        span = self.last_token - self.first_token
        return (self.completion_tokens - 1) / span if span > 0 else None

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def status_text(
    model: str | None, state: str, stats: GenStats | None, max_model_len: int | None
) -> str:
    """`model · state · 23.4 tok/s · ctx 312/8192 (4%)`."""
    parts = [model or "no model", state]
    if stats is not None:
        tps = stats.tokens_per_s
        parts.append(f"{tps:.1f} tok/s" if tps is not None else "-- tok/s")
        used = stats.context_tokens
        if max_model_len:
            parts.append(f"ctx {used}/{max_model_len} ({100 * used // max_model_len}%)")
        else:
            parts.append(f"ctx {used}")
    elif max_model_len:
        parts.append(f"ctx 0/{max_model_len}")
    return " · ".join(parts)
