"""`ModelRouter`: which engine serves a request's `model`, loading and unloading engines as needed.

Models load on first use in a worker thread (the event loop never blocks; concurrent first
requests share one load) and unload after an idle TTL (Ollama's keep_alive) or when a new model
needs room under `max_loaded` / a byte budget: least recently used idle models go first, and a
model with running requests is never unloaded. With one preloaded engine and no loader (the
single-model server) nothing is ever unloaded. All state changes happen on the event loop.
"""

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.app.server.errors import APIError
from localllm.app.server.metrics import ServerMetrics
from localllm.app.server.settings import ServerSettings
from localllm.engine.fim import fim_tokens_for
from localllm.engine.hf import is_hf_folder
from localllm.engine.hf.families import HF_FAMILIES
from localllm.engine.loader import load_tokenizer, open_weights
from localllm.engine.models import model_module

_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# A just-resolved model is busy for this long, covering the moment before its stream starts.
RESOLVE_GRACE_S = 2.0
POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One servable model: the id clients see, its file and what its header says."""

    id: str
    path: Path | None = None
    names: frozenset[str] = frozenset()  # other names a request may use (file name, -m text)
    nbytes: int = 0  # tensor bytes (all shards): what loading it costs in the byte budget
    context_length: int | None = None  # the model's own, capped by --ctx-size
    fim: bool = False  # has fill-in-the-middle tokens
    generates: bool = True  # False for encoder-only (embedding) models such as BERT
    cross_encoder: bool = False  # a classification head (`cls.*`): a reranker, not an embedder

    def matches(self, name: str) -> bool:
        return name == self.id or name in self.names


@dataclass
class _Slot:
    entry: ModelEntry
    engine: Any = None
    loading: "asyncio.Future[Any] | None" = None
    active: int = 0  # engine streams open through a handle
    last_used: float = 0.0
    metrics: ServerMetrics = field(default_factory=ServerMetrics)


class ModelHandle:
    """The engine as an endpoint sees it: `generate`/`chat` streams count as running requests."""

    def __init__(self, engine: Any, slot: _Slot, router: "ModelRouter"):
        self._engine, self._slot, self._router = engine, slot, router

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def _counted(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        self._router._begin(self._slot)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # at once: closing the engine stream aborts the request
            self._router._end(self._slot)

    def generate(self, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        return self._counted(self._engine.generate(*args, **kw))

    def chat(self, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        return self._counted(self._engine.chat(*args, **kw))


def close_engine(engine: Any) -> None:
    """Stop an engine's thread (nothing runs on it by then) and unmap its file."""
    engine.shutdown(abort=False)
    inner = getattr(engine, "engine", None)
    if inner is not None and hasattr(inner, "close"):
        inner.close()


class ModelRouter:
    def __init__(
        self,
        entries: Sequence[ModelEntry],
        loader: Callable[[ModelEntry], Any] | None,
        *,
        idle_unload: float = 0.0,
        max_loaded: int | None = None,
        memory_budget: int | None = None,
        available: Callable[[], int] | None = None,
        closer: Callable[[Any], None] = close_engine,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not entries:
            raise ValueError("no models to serve")
        ids = [e.id for e in entries]
        if len(set(ids)) != len(ids):
            raise ValueError(f"model ids must be unique: {ids}")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError("max_loaded must be >= 1")
        self._slots = {e.id: _Slot(e) for e in entries}
        self._loader, self._closer, self._clock = loader, closer, clock
        self.idle_unload, self.max_loaded = idle_unload, max_loaded
        self.memory_budget = memory_budget
        self._available = available
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    def single(cls, engine: Any, settings: ServerSettings) -> "ModelRouter":
        """The one-model server: preloaded, never unloaded."""
        ctx = getattr(engine, "max_model_len", None)
        core = getattr(engine, "engine", None)
        gguf = getattr(core, "gguf", None)
        fim = gguf is not None and fim_tokens_for(gguf.metadata, engine.tokenizer) is not None
        generates = getattr(core, "generates", True)
        cross = bool(getattr(core, "can_rank", False))
        entry = ModelEntry(settings.model_id, names=settings.model_names, context_length=ctx,
                           fim=fim, generates=generates, cross_encoder=cross)  # fmt: skip
        router = cls([entry], None)
        router._slots[entry.id].engine = engine
        return router

    # -- lookups ------------------------------------------------------------------------------

    @property
    def entries(self) -> list[ModelEntry]:
        return [s.entry for s in self._slots.values()]

    @property
    def default(self) -> ModelEntry:
        return next(iter(self._slots.values())).entry

    def find(self, name: str | None) -> ModelEntry:
        """The entry a request's `model` names (the default when omitted); 404 when none."""
        if not name:
            return self.default
        for slot in self._slots.values():
            if slot.entry.matches(name):
                return slot.entry
        served = ", ".join(repr(i) for i in self._slots)
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    def engine(self, entry: ModelEntry) -> Any:
        """The loaded engine of `entry`, or None (never loads)."""
        return self._slots[entry.id].engine

    def status(self, entry: ModelEntry) -> str:
        slot = self._slots[entry.id]
        if slot.engine is not None:
            return "loaded"
        return "loading" if slot.loading is not None else "unloaded"

    def metrics_for(self, model_id: str | None) -> ServerMetrics:
        slot = self._slots.get(model_id or "") or next(iter(self._slots.values()))
        return slot.metrics

    def loaded(self) -> list[tuple[ModelEntry, Any]]:
        return [(s.entry, s.engine) for s in self._slots.values() if s.engine is not None]

    # -- acquiring ----------------------------------------------------------------------------

    async def acquire(self, entry: ModelEntry, timeout: float | None = None) -> Any:
        """The engine serving `entry`, loaded now if needed; waits (up to `timeout`) while the
        models that would have to make room are all busy."""
        slot = self._slots[entry.id]
        if self._loader is None:  # single-model server: the raw engine, exactly as before
            slot.last_used = self._clock()
            return slot.engine
        self._start_reaper()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while slot.engine is None:
            if slot.loading is None:
                await self._make_room(slot, deadline)
                if slot.engine is not None or slot.loading is not None:
                    continue
                slot.loading = asyncio.ensure_future(self._load(slot))
            await asyncio.shield(slot.loading)
        slot.last_used = self._clock()
        return ModelHandle(slot.engine, slot, self)

    async def _load(self, slot: _Slot) -> None:
        assert self._loader is not None
        try:
            slot.engine = await asyncio.to_thread(self._loader, slot.entry)
        except Exception as e:
            raise APIError(500, f"could not load model {slot.entry.id!r}: {e}") from e
        finally:
            slot.loading = None

    def _busy(self, slot: _Slot) -> bool:
        return slot.active > 0 or self._clock() - slot.last_used < RESOLVE_GRACE_S

    def _fits(self, slot: _Slot, others: list[_Slot]) -> tuple[bool, bool]:
        """(within the hard limits: count and budget, within free memory)."""
        hard = self.max_loaded is None or len(others) < self.max_loaded
        if self.memory_budget is not None:
            hard &= sum(s.entry.nbytes for s in others) + slot.entry.nbytes <= self.memory_budget
        free = self._available is None or slot.entry.nbytes <= self._available()
        return hard, free

    async def _make_room(self, slot: _Slot, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            others = [
                s
                for s in self._slots.values()
                if s is not slot and (s.engine is not None or s.loading is not None)
            ]
            hard, free = self._fits(slot, others)
            if not others or (hard and free):
                return
            idle = [s for s in others if s.engine is not None and not self._busy(s)]
            if idle:
                await self._unload(min(idle, key=lambda s: s.last_used))
                continue
            if hard:  # short of free memory only, and nothing idle to give back: try anyway
                return
            if deadline is not None and loop.time() >= deadline:
                raise APIError(
                    503, f"no room to load {slot.entry.id!r}: every loaded model is busy",
                    code="model_busy",
                )  # fmt: skip
            await asyncio.sleep(POLL_S)

    async def _unload(self, slot: _Slot) -> None:
        engine, slot.engine = slot.engine, None
        if engine is not None:
            await asyncio.to_thread(self._closer, engine)

    def _begin(self, slot: _Slot) -> None:
        slot.active += 1
        slot.last_used = self._clock()

    def _end(self, slot: _Slot) -> None:
        slot.active -= 1
        slot.last_used = self._clock()  # the idle TTL counts from the end of the last request

    # -- idle unloading -----------------------------------------------------------------------

    def _start_reaper(self) -> None:
        if self.idle_unload > 0 and (self._reaper is None or self._reaper.done()):
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        period = min(max(self.idle_unload / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            await self.unload_idle()

    async def unload_idle(self) -> list[str]:
        """Unload every model idle for at least the TTL; returns their ids."""
        now, gone = self._clock(), []
        for slot in list(self._slots.values()):
            if slot.engine is None or slot.active or now - slot.last_used < self.idle_unload:
                continue
            gone.append(slot.entry.id)
            await self._unload(slot)
        return gone

    def shutdown(self, abort: bool = True) -> None:
        """Stop every loaded engine (the server is exiting), aborting in-flight requests."""
        if self._reaper is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                self._reaper.cancel()
        for slot in self._slots.values():
            engine, slot.engine = slot.engine, None
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.shutdown(abort=abort)


def as_router(engine: Any, settings: ServerSettings) -> ModelRouter:
    """`create_app`'s engine argument as a router: a `ModelRouter` as is, one engine wrapped."""
    return engine if isinstance(engine, ModelRouter) else ModelRouter.single(engine, settings)


def model_files(directory: Path) -> list[Path]:
    """Every model under `directory`: each GGUF (a split set once, by its first shard; no
    mmproj) and each Hugging Face folder of an architecture we run (other folders, a MusicGen
    say, are not language models)."""
    out = []
    for p in sorted(directory.rglob("*.gguf")):
        if "mmproj" in p.name.lower() or not p.is_file():
            continue
        m = _SHARD.match(p.name)
        if m is not None and int(m["no"]) != 1:
            continue
        out.append(p)
    for config in sorted(directory.rglob("config.json")):
        folder = config.parent
        if is_hf_folder(folder) and _hf_architecture(config) in HF_FAMILIES:
            out.append(folder)
    return out


def _hf_architecture(config: Path) -> str | None:
    try:
        arches = json.loads(config.read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return arches[0] if isinstance(arches, list) and arches and isinstance(arches[0], str) else None


def model_id_for(path: Path) -> str:
    """The id clients see: the file stem, without a split's `-00001-of-0000N`; a folder's name
    (a Hub cache snapshot's: its repository's)."""
    if path.is_dir():
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
            return path.parent.parent.name.split("--", 2)[-1]
        return path.name
    m = _SHARD.match(path.name)
    return m["prefix"] if m is not None else path.stem


def describe_model(
    path: Path, model_id: str, names: frozenset[str] = frozenset(), ctx_size: int | None = None
) -> ModelEntry:
    """An entry from the GGUF header alone (no weights read): size, context, FIM tokens."""
    with open_weights(path) as g:  # a GGUF, or a Hugging Face folder read as one
        meta = g.metadata
        ctx = meta.get(f"{g.architecture}.context_length")
        ctx = int(ctx) if isinstance(ctx, int) else None
        if ctx_size is not None:
            ctx = ctx_size if ctx is None else min(ctx, ctx_size)
        try:
            fim = fim_tokens_for(meta, load_tokenizer(g)) is not None
        except ValueError:  # no usable tokenizer: loading will say why
            fim = False
        try:
            model_class = model_module(g.architecture or "").Model
        except (ValueError, AttributeError):  # unsupported: loading will say why
            model_class = None
        generates = getattr(model_class, "generates", True)
        cross = not generates and any(name.startswith("cls.") for name in g.tensors)
        return ModelEntry(model_id, path, names, g.nbytes, ctx, fim, generates, cross)
