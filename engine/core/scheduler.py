"""The scheduler: which requests compute how many tokens this step, and what happens after.

There is no prefill phase and no decode phase. Each request has `num_tokens_with_spec` (prompt,
output and draft tokens) and `num_computed_tokens`; a step hands out a token budget so that the
second catches up with the first. Running requests go first (FCFS), then waiting ones; a prompt
that does not fit the budget is chunked over several steps. When the KV pool runs dry the newest
running request is preempted: its blocks are freed and it recomputes later (the prefix cache
usually gives most of them back).
"""

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from localllm.engine.core.kv_manager import KVCacheManager
from localllm.engine.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # requests in one step
    max_num_batched_tokens: int = 512  # tokens in one step (bounds activation memory)
    max_model_len: int = 4096  # prompt + output tokens of one request
    # a decode token's next slot is allocated with it when a block is free (never by preempting):
    # the runner launches the next step ahead only where its slot exists
    # (`engine.runtime.decode_ahead`)
    lookahead_slots: int = 0
    # a multimodal item's tokens are computed in one step (models whose image tokens attend both
    # ways: a chunk ending inside an image stops before it; one starting inside runs to its end,
    # past the token budget if it must)
    whole_mm_spans: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)  # batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Draft tokens being verified this step (a prefix of request.spec_token_ids).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # Recurrent-state models: (src, dst) state slots the runner copies before the forward (forks)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.state_copies = self.kv.take_state_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            n = min(n, self.config.max_model_len - req.num_computed_tokens)
            n = self._pause_at_fork_point(req, n)
            n = self._whole_spans(req, req.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            if not self._lookahead(req, n):
                while self.kv.allocate_slots(req, n) is None:
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        return budget
            self._add_to_batch(out, req, n)
            budget -= n
            i += 1
        return budget

    def _lookahead(self, req: Request, n: int) -> bool:
        """A decode token's slot and the next ones allocated together, if free blocks allow."""
        extra = self.config.lookahead_slots
        if not extra or n != 1 or req.num_tokens_with_spec - req.num_computed_tokens != 1:
            return False
        extra = min(extra, self.config.max_model_len - req.num_computed_tokens - 1)
        return extra > 0 and self.kv.allocate_slots(req, n + extra) is not None

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.fork_of is not None and not self._fork_ready(req):
                skipped.append(req)  # a sibling of n > 1 waits for the shared prompt KV
                continue
            hit_blocks, num_hit = [], 0
            if req.fork_of is not None:
                num_hit = self.kv.fork(req.fork_of, req, req.num_prompt_tokens)
                req.num_computed_tokens = num_hit  # the shared blocks are in its table already
            elif req.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            n = self._pause_at_fork_point(req, n)
            n = self._whole_spans(req, num_hit, n)
            if self.kv.allocate_slots(req, n, hit_blocks) is None:
                if req.fork_of is not None:
                    self.kv.free(req)
                    req.num_computed_tokens = 0
                self.waiting.appendleft(req)
                break
            req.fork_of = None
            req.num_computed_tokens = num_hit
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_to_batch(out, req, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _fork_ready(self, req: Request) -> bool:
        src = req.fork_of
        if src.finished or src.status is not RequestStatus.RUNNING:
            req.fork_of = None  # the sibling is gone: compute the prompt itself
            return True
        # The blocks a fork shares (full ones, short of the last prompt token) must hold KV already.
        shared = (req.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        return src.num_computed_tokens >= shared

    def _whole_spans(self, req: Request, start: int, n: int) -> int:
        """`n` moved so the chunk [start, start + n) does not end inside a multimodal item."""
        if not self.config.whole_mm_spans:
            return n
        for it in req.mm_inputs:
            if it.start < start + n < it.end:
                n = it.start - start if start < it.start else it.end - start
        return n

    def _pause_at_fork_point(self, req: Request, n: int) -> int:
        """A recurrent-state model's prompt with forks waiting stops a step at the point they
        share (`KVCacheManager.fork_point`): its state there is what they copy."""
        if self.kv.states is None:
            return n
        point = self.kv.fork_point(req.num_prompt_tokens)
        if req.num_computed_tokens < point and any(w.fork_of is req for w in self.waiting):
            return min(n, point - req.num_computed_tokens)
        return n

    def _add_to_batch(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.requests.append(req)
        out.num_scheduled_tokens[req.request_id] = n
        if req.spec_token_ids:
            # Drafts beyond the scheduled range are dropped; the rest are verified this step.
            num_spec = max(0, req.num_computed_tokens + n - req.num_tokens)
            del req.spec_token_ids[num_spec:]
            if num_spec:
                out.spec_tokens[req.request_id] = list(req.spec_token_ids)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids.clear()
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Advance computed counts, drop rejected drafts, append accepted tokens, cache full blocks.

        `sampled[request_id]` holds the tokens the runner accepted for requests that reached the
        end of their known tokens (empty or absent for a prompt chunk that did not).
        """
        for req in out.requests:
            if req.finished:
                continue  # aborted while the step ran
            if req.error is not None:
                self.finish(req, "error")
                continue
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            spec = out.spec_tokens.get(req.request_id)
            tokens = sampled.get(req.request_id, [])
            if spec:
                # Drafts after the first rejection were computed on a wrong prefix: roll back.
                req.num_computed_tokens -= len(spec) + 1 - len(tokens)
                req.metrics.spec_proposed += len(spec)
                req.metrics.spec_accepted += len(tokens) - 1
            req.spec_token_ids.clear()
            self.kv.cache_blocks(req, req.num_computed_tokens)
            for tok in tokens:
                req.append_output(tok)
                if self._check_stop(req, tok):
                    break

    def _check_stop(self, req: Request, tok: int) -> bool:
        # The sampler masks end-of-generation ids until min_tokens, so any one seen here counts.
        if tok in req.eos_ids or tok in req.params.stop_token_ids:
            self.finish(req, "stop", tok)
            return True
        if req.grammar is not None:
            if not req.grammar.accept(tok):
                req.error = f"token {tok} was not allowed by the grammar"
                self.finish(req, "error")
                return True
            if req.grammar.is_terminated:
                self.finish(req, "stop")
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self.finish(req, "length")
            return True
        return False

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (done, stopped by text, aborted or failed) and release its blocks."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self.kv.free(req)
        req.finish(reason, stop_reason)
