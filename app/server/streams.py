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
    """`stream`'s deltas, under the request's timeout (its `timeout` field or the server's);
    raises what the engine raised, and 408 at the deadline."""
    state = request.app.state
    # resolve_model set the request's own timeout (bounded by --timeout) and its model.
    timeout = getattr(request.state, "timeout", state.settings.request_timeout)
    metrics = state.router.metrics_for(getattr(request.state, "model_id", None))
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
    except APIError as e:
        # A timeout aborts the request (vLLM counts it as "abort"); a refusal never ran.
        reason = "abort" if e.code == "timeout" else "error" if last is not None else "rejected"
        raise
    except Exception:
        reason = "error" if last is not None else "rejected"
        raise
    finally:
        await stream.aclose()  # leaving the engine stream early aborts the request there
        if reason != "rejected":
            metrics.record(last, reason)


async def with_first(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """A stream whose first item was taken early (to fail with a plain HTTP error)."""
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def all_or_none(works: list[Awaitable[T]]) -> list[T]:
    """Await all; the first failure cancels the rest (closing their engine streams), then raises."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(w) for w in works]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they arrive, tagged with the stream's position."""
    if len(streams) == 1:  # the usual request: no pump task and queue hop per item
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
