"""How the TUI gets a chat backend: load a local model or connect to an endpoint, never blocking
the event loop (the blocking parts run in threads)."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from localllm.app.tui.backend import ChatBackend

# Given a model reference (path, library name; None = the default), produce a ready backend.
Loader = Callable[[str | None], Awaitable[ChatBackend]]


def engine_loader(**engine_args: Any) -> Loader:
    async def load(name: str | None, residency: Any = None) -> ChatBackend:
        """`residency` (a `ResidencyConfig`): this load's, in place of `engine_args`' own."""
        from localllm.app.hub.spec import parse_spec
        from localllm.app.model_path import resolve_model
        from localllm.app.tui.engine_backend import EngineBackend

        if name and parse_spec(name).kind == "hub":
            # resolve_model would ask on the terminal; the TUI downloads hub models itself.
            raise ValueError(f"{name} is a Hub model: download it from the Models screen first")
        path = await asyncio.to_thread(resolve_model, name, yes=False)
        args = engine_args if residency is None else {**engine_args, "residency": residency}
        return await asyncio.to_thread(EngineBackend.load, path, **args)

    load.local = True  # the app resolves Hub specs (downloading them) before calling us
    load.device = engine_args.get("device", "cpu")  # where a load dialog's plan is made for
    return load


def endpoint_loader(url: str, api_key: str | None = None) -> Loader:
    async def load(name: str | None) -> ChatBackend:
        from localllm.app.tui.endpoint_backend import EndpointBackend

        return await EndpointBackend(url, model=name, api_key=api_key).connect()

    return load
