"""`AsyncEngine`: one thread owns the engine (and the device); asyncio callers talk to it by queue.

The server and the TUI never touch the model directly. `generate()` sends an "add" command and
returns an async stream of deltas; leaving the stream early (a client disconnect, a cancelled task)
aborts the request. `embed()` queues an embedding job whose batches run on the same thread,
one batch between two generation steps. `shutdown()` either lets in-flight requests finish or
aborts them, then joins the thread.
"""

import asyncio
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localllm.engine.config import EngineArgs
from localllm.engine.core.outputs import RequestOutput
from localllm.engine.embedder import EmbeddingOutput, EmbedJob
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.multimodal import MultiModalInput
from localllm.engine.sampling.params import SamplingParams

log = logging.getLogger(__name__)

# hand a step's outputs to each event loop in one callback (False: one per output, for A/B):
# every `call_soon_threadsafe` writes the loop's wake-up pipe and takes the GIL from the loop's
# thread, 64 times a step at 64 streams (tests/perf/results/server.md)
BATCH_DELIVERY = True


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no new requests are taken."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._abort_all = False  # set by shutdown(abort=True): later adds are refused
        self._jobs: deque[tuple[str, EmbedJob]] = deque()  # embedding jobs (engine thread only)
        self._thread = threading.Thread(target=self._loop, name="localllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> "AsyncEngine":
        return cls(LLMEngine(model, EngineArgs(**engine_args)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def embedding_dim(self) -> int:
        return self.engine.embedding_dim

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    # -- caller side (any event loop thread) -------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas (new text and ids per completion) until the request finishes.

        A bad request raises here, before the first output; the engine keeps serving others.
        `mm_inputs`: image embeddings for the prompt's placeholders (`engine.multimodal`).
        """
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added: asyncio.Future = loop.create_future()
        with self._lock:
            # Registered before any await: from here on the request counts as in flight, and a
            # shutdown that lets work finish waits for it.
            if self._closing or not self._thread.is_alive():
                raise EngineDeadError("the engine is shut down")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        finished = False
        try:
            # Tokenizing, checks and grammar compilation happen here, off the engine thread: a
            # bad request fails at once and a slow compile never stalls the others' decoding.
            prepared = await asyncio.to_thread(self.engine.prepare, prompt, params, mm_inputs)
            self._commands.put(("add", (rid, prepared, cache_salt), added))
            await added  # raises if the engine refused it
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)
            elif self._closing:
                self._commands.put(("wake", None, None))  # a stopping thread re-checks

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
        continue_final: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """`generate` on the conversation rendered with the model's chat template (continuing its
        last message when `continue_final`).

        Rendering and tokenizing run in a worker thread: a long conversation or a slow template
        takes seconds, which on the caller's event loop would stall every other client.
        """
        kwargs = dict(chat_template_kwargs or {})
        ids = await asyncio.to_thread(
            self.engine.chat_prompt, messages, tools=tools, continue_final=continue_final, **kwargs
        )
        async for out in self.generate(ids, params, request_id, cache_salt=cache_salt):
            yield out

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        pooling: str | None = None,
        normalize: bool = True,
        *,
        truncate: int | None = None,
    ) -> list[EmbeddingOutput]:
        """`LLMEngine.embed` on the engine thread, between generation steps.

        Tokenizing and checks happen here, off the engine thread; a bad input raises at once.
        """
        rid = f"embed-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        with self._lock:
            # Registered like a generation: a shutdown that lets work finish waits for it.
            if self._closing or not self._thread.is_alive():
                raise EngineDeadError("the engine is shut down")
            self._streams[rid] = stream
        try:
            job = await asyncio.to_thread(self._embedding_job, inputs, pooling, normalize, truncate)
            self._commands.put(("embed", (rid, job), None))
            result = await stream.queue.get()
            if isinstance(result, BaseException):
                raise result
            return result
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if self._closing:
                self._commands.put(("wake", None, None))  # a stopping thread re-checks

    def _embedding_job(self, inputs, pooling, normalize, truncate) -> EmbedJob:
        seqs = self.engine.prepare_embedding(inputs, truncate)
        return self.engine.embedding_job(seqs, pooling, normalize)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def shutdown(self, abort: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: abort in-flight requests, or (abort=False) let them finish."""
        if not self._thread.is_alive():
            return
        self._closing = True
        self._commands.put(("stop", abort, None))
        self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        stopping = False
        while True:
            idle = not engine.has_unfinished_requests() and not self._jobs
            if stopping and idle:
                with self._lock:
                    if not self._streams:  # nobody is still preparing or reading
                        break
            try:
                cmd = self._commands.get(block=idle)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                stopping |= self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            self._embed_step()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug, not a bad request: fail everyone, keep running
                log.exception("engine step crashed")
                for rid in list(engine.groups):
                    engine.abort_request(rid)
                    self._deliver_error(rid, RuntimeError(f"engine step failed: {e}"))
                engine.groups.clear()
                continue
            if BATCH_DELIVERY:
                self._deliver_many([(out.request_id, out) for out in outputs])
            else:
                for out in outputs:
                    self._deliver(out.request_id, out)
        self._fail_all(EngineDeadError("the engine is shut down"))

    def _handle(self, cmd) -> bool:
        kind, payload, fut = cmd
        if kind == "add":
            rid, prepared, salt = payload
            if self._abort_all:
                self._resolve(rid, fut, EngineDeadError("the engine is shut down"))
                return False
            try:
                self.engine.add_request(rid, prepared, cache_salt=salt, delta=True)
            except Exception as e:
                self._resolve(rid, fut, e)
            else:
                self._resolve(rid, fut, None)
        elif kind == "embed":
            rid, job = payload
            if self._abort_all:
                self._deliver(rid, EngineDeadError("the engine is shut down"))
            else:
                self._jobs.append((rid, job))
        elif kind == "abort":
            self.engine.abort_request(payload)
        elif kind == "stop":
            if payload:
                self._abort_all = True
                self.engine.abort_request(list(self.engine.groups))
                for rid, _ in self._jobs:
                    self._deliver(rid, EngineDeadError("the engine is shut down"))
                self._jobs.clear()
            return True
        return False

    def _embed_step(self) -> None:
        """One batch of the oldest embedding job (a big job never stalls decoding for long)."""
        if not self._jobs:
            return
        rid, job = self._jobs[0]
        with self._lock:
            wanted = rid in self._streams
        try:
            if wanted:
                job.step()
        except Exception as e:
            log.exception("embedding failed")
            self._jobs.popleft()
            self._deliver(rid, RuntimeError(f"embedding failed: {type(e).__name__}: {e}"))
            return
        if not wanted or job.done:
            self._jobs.popleft()
            if wanted:
                self._deliver(rid, job.outputs())

    def _resolve(self, rid: str, fut: asyncio.Future, error: Exception | None) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            if error is None:
                self.engine.abort_request(rid)  # the caller left before the add landed
            return

        def done():
            if fut.done():
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

        stream.loop.call_soon_threadsafe(done)

    def _deliver(self, rid: str, item) -> None:
        self._deliver_many([(rid, item)])

    def _deliver_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """(request id, output or error) pairs to their streams, one callback per event loop
        that reads some of them; a request whose loop is closed is aborted."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for rid, item in items:
                stream = self._streams.get(rid)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item, rid))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop is closed
                for _, _, rid in batch:
                    self.engine.abort_request(rid)

    def _deliver_error(self, rid: str, error: BaseException) -> None:
        self._deliver(rid, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            rids = list(self._streams)
        self._deliver_many([(rid, error) for rid in rids])


def _put_all(items: list) -> None:
    for q, item, _ in items:
        q.put_nowait(item)
