"""What the engine hands back: per-request outputs, logprobs, usage and timings.

Shapes follow vLLM's `RequestOutput` / `CompletionOutput` so code written for it reads ours.
`AsyncEngine` streams deltas (only the new text and ids); `LLM.generate` returns final outputs.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock stamps (time.monotonic) and the figures derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0  # draft tokens proposed / accepted (speculative decoding)
    spec_accepted: int = 0

    @property
    def queue_time(self) -> float | None:
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def ttft(self) -> float | None:
        s = self.first_token_time
        return None if s is None else s - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_generated < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated - 1)

    @property
    def e2e(self) -> float | None:
        f = self.finished_time
        return None if f is None else f - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    usage: Usage = field(default_factory=Usage)
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when finish_reason is "error" (e.g. the grammar hit a dead end)
