"""How the TUI gets a chat backend: load a local model or connect to an endpoint, never blocking
the event loop (the blocking parts run in daemon threads, which quitting does not wait for)."""

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from localllm.app.tui.backend import ChatBackend

T = TypeVar("T")

# Given a model reference (path, library name; None = the default), produce a ready backend.
Loader = Callable[[str | None], Awaitable[ChatBackend]]


async def in_daemon_thread(
    fn: Callable[..., T], *args: Any, orphan: Callable[[T], None] | None = None
) -> T:
    """`fn(*args)` in a daemon thread. Unlike `asyncio.to_thread`, whose threads the event loop
    joins at exit, a minutes-long model load does not hold up quitting. When the caller is
    cancelled before `fn` returns, `orphan` gets the late result (to release what it holds)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def release(result: T) -> None:
        if orphan is not None:
            threading.Thread(target=orphan, args=(result,), daemon=True).start()

    def settle(ok: bool, value: Any) -> None:  # on the loop
        if future.done():  # the caller gave up (quit, another load)
            if ok:
                release(value)
        elif ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed to the caller, who reports it
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: the app has exited
            if ok:
                release(value)

    threading.Thread(target=run, name="localllm-load", daemon=True).start()
    return await future


def engine_loader(mmproj: tuple[str | None, str] | None = None, **engine_args: Any) -> Loader:
    """`mmproj`: (model name, projector path) given on the command line for that model; any
    other model gets the projector pulled with it from the Hub, if any (nothing is guessed; the
    library and downloads load a pulled model by its path in the cache: `pulled_mmproj`)."""

    async def load(name: str | None, residency: Any = None, lora: tuple = ()) -> ChatBackend:
        """`residency` (a `ResidencyConfig`): this load's, in place of `engine_args`' own;
        `lora`: `PATH[:SCALE]` adapters, in place of `engine_args`' own."""
        from localllm.app.hub.spec import parse_spec
        from localllm.app.model_path import resolve_model
        from localllm.app.tui.engine_backend import EngineBackend

        if name and parse_spec(name).kind == "hub":
            # resolve_model would ask on the terminal; the TUI downloads hub models itself.
            raise ValueError(f"{name} is a Hub model: download it from the Models screen first")
        path = await in_daemon_thread(lambda: resolve_model(name, yes=False))
        args = engine_args if residency is None else {**engine_args, "residency": residency}
        if lora:
            from localllm.engine.lora import LoraSpec

            args = {**args, "lora": tuple(LoraSpec.parse(s) for s in lora)}
        proj = await in_daemon_thread(_projector, name, mmproj)
        if proj is not None:
            args = {**args, "mmproj": proj}
        return await in_daemon_thread(
            lambda: EngineBackend.load(path, **args), orphan=lambda b: b.engine.shutdown(True)
        )

    load.local = True  # the app resolves Hub specs (downloading them) before calling us
    load.device = engine_args.get("device", "cpu")  # where a load dialog's plan is made for
    return load


def _projector(name: str | None, given: tuple[str | None, str] | None):
    if given is not None and given[0] == name:
        return Path(given[1]).expanduser()
    from localllm.app.hub.pairing import paired_mmproj, pulled_mmproj

    return paired_mmproj(name) or pulled_mmproj(name)


def endpoint_loader(url: str, api_key: str | None = None) -> Loader:
    async def load(name: str | None) -> ChatBackend:
        from localllm.app.tui.endpoint_backend import EndpointBackend

        return await EndpointBackend(url, model=name, api_key=api_key).connect()

    return load
