"""A request as the scheduler sees it: its tokens, how many have KV computed, and its state.

The one invariant (vLLM v1): `num_computed_tokens` catches up with `num_tokens_with_spec` under the
step's token budget. Prefill, chunked prefill, prefix-cache hits, decode and speculative
verification are all just "compute the next tokens of this request".
"""

import enum
import time
from collections.abc import Sequence
from typing import Any

import torch

from localllm.engine.core.outputs import RequestMetrics
from localllm.engine.multimodal import MultiModalInput, RopePositions
from localllm.engine.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits again and recomputes its tokens
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_ids: frozenset[int] = frozenset(),
        max_tokens: int = 16,
        cache_salt: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
    ):
        self.request_id = request_id
        self.params = params
        self.index = index  # which of the n completions of one prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, the KV's token sequence
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []  # drafts to verify in the next step
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache (first admission)
        self.max_tokens = max_tokens  # already clipped to the context
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.cache_salt = cache_salt
        self.mm_inputs = tuple(mm_inputs)  # images: placeholder positions + embeddings
        # M-RoPE models: the prompt's 3-axis positions, laid out once here (else None)
        self.rope = RopePositions.of(self.mm_inputs, len(self.prompt_token_ids))
        self.lora: tuple[tuple[int, float], ...] = ()  # (adapter slot, factor): engine.lora
        self.block_hashes: list[Any] = []  # filled by the KV manager, one per full block
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time or time.monotonic())
        self.rng: torch.Generator | None = None
        if not params.greedy:
            self.rng = torch.Generator()
            if params.seed is None:
                self.rng.seed()
            else:
                self.rng.manual_seed(params.seed + index)
        self.grammar: Any = None  # a structured-output matcher, when params.structured is set
        self.fork_of: Request | None = None  # n > 1: waits for this sibling's prompt KV
        self.logprobs: list[dict] = []  # per generated token, when params.logprobs is set
        self.prompt_logprobs: list[dict | None] = []  # per prompt token (first is None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
