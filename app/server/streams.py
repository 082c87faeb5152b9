"""Driving one engine stream for an HTTP request: timeout, metrics, disconnects, aggregation.

Every endpoint goes through `drive()`: it stops waiting at the request's deadline, and whatever
way the stream ends (finish, error, client gone) it closes the engine stream, which aborts the
request in the engine, and reports the request to `/metrics`.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from localllm.app.server.errors import APIError
from localllm.engine.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput

T = TypeVar("T")


async def drive(
    request: Request, stream: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """`stream`'s deltas, under the server's per-request timeout; raises what the engine raised."""
    state = request.app.state
    timeout = state.settings.request_timeout
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    last: RequestOutput | None = None
    reason = "abort"
    try:
        while True:
            step = anext(stream)
            try:
                if deadline is None:
                    out = await step
                else:
                    out = await asyncio.wait_for(step, max(deadline - loop.time(), 0.0))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise APIError(408, f"the request ran past {timeout} s", code="timeout") from None
            last = out
            if out.finished:
                reason = "error" if out.error else _reason(out)
            yield out
            if out.finished:
                return
    except Exception:
        reason = "error" if last is not None else "rejected"
        raise
    finally:
        await stream.aclose()  # leaving the engine stream early aborts the request there
        if reason != "rejected":
            state.metrics.record(last, reason)


async def with_first(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """A stream whose first item was taken early (to fail with a plain HTTP error)."""
    yield first
    if not first.finished:
        async for out in rest:
            yield out


def _reason(out: RequestOutput) -> str:
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
    return reasons[-1] if reasons else "stop"


async def unless_disconnected(request: Request, work: Awaitable[T], poll: float = 0.25) -> T:
    """Await `work`, cancelling it (so the engine aborts) if the client hangs up meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


@dataclass
class Completion:
    """One completion assembled from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


@dataclass
class Collected:
    completions: list[Completion]
    last: RequestOutput


async def collect(request: Request, stream: AsyncIterator[RequestOutput], n: int) -> Collected:
    """The whole result of a non-streaming request; an in-stream error becomes a 500."""
    comps = [Completion(i) for i in range(n)]
    last = None
    async for out in drive(request, stream):
        last = out
        for c in out.outputs:
            comps[c.index].add(c)
    if last is None:
        raise APIError(500, "the engine ended the request without output")
    if last.error:
        raise APIError(500, f"generation failed: {last.error}", code="generation_error")
    return Collected(comps, last)
