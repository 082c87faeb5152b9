"""`create_app(engine, settings)`: the FastAPI app, its routers, guards and error mapping.

The guards are plain ASGI middleware so they run before any body parsing: the body-size limit
(Content-Length and the bytes actually streamed) and the optional API key. CORS is added only
when origins are configured.
"""

import asyncio
import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from localllm.app.server import (
    audio,
    chat,
    completions,
    embeddings,
    infill,
    lora,
    messages,
    metrics,
    models,
    music,
    rerank,
    responses,
    speech,
    tokenize,
)
from localllm.app.server.errors import error_body, install_error_handlers
from localllm.app.server.router import as_router
from localllm.app.server.settings import ServerSettings

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health"})
# Endpoint families, one module each, every one exporting `router`.
ROUTERS = (
    models, chat, completions, infill, tokenize, metrics, audio, speech, responses, messages,
    embeddings, rerank, music, lora,
)  # fmt: skip


async def _send_error(
    send, status: int, message: str, code: str | None = None, *, close: bool = False
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:  # the rest of the request is unread: the connection cannot carry another
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """API key check, then the body read whole (up to the limit) and replayed to the app."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        key = self.settings.api_key
        if key is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not given:  # Anthropic clients send the key as `x-api-key`
                given = headers.get(b"x-api-key", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), key.encode()):
                await _send_error(send, 401, "missing or invalid API key", "invalid_api_key")
                return
        limit = self.settings.max_body_bytes
        too_big = f"the request body is larger than {limit} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, 413, too_big, "body_too_large")
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self._answered(scope, receive, send)
            return
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.settings.read_timeout):
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return  # the client left before sending the body
                    chunks.append(msg.get("body", b""))
                    size += len(chunks[-1])
                    if size > limit:
                        await _send_error(send, 413, too_big, "body_too_large")
                        return
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            timeout = self.settings.read_timeout
            await _send_error(send, 408, f"the request body did not arrive within {timeout} s",
                              "body_timeout", close=True)  # fmt: skip
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: http.disconnect, for disconnect detection

        await self._answered(scope, replay, send)

    async def _answered(self, scope, receive, send) -> None:
        """The app, with an exception it lets out answered here as a 500 and not raised on:
        uvicorn closes the connection on a raised error, and the client's next request on that
        keep-alive connection would be reset."""
        started = False

        async def tracked(message):
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            log.error("internal error", exc_info=e)
            if started:  # too late for a status: the stream ends here
                raise
            await _send_error(send, 500, f"internal error: {type(e).__name__}: {e}")


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The server app over a started `AsyncEngine`; the caller owns (and shuts down) the engine."""
    app = FastAPI(title="localllm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine  # one AsyncEngine, or a ModelRouter over several models
    app.state.settings = settings
    app.state.router = as_router(engine, settings)  # endpoints get engines via resolve_model
    app.state.metrics = app.state.router.metrics_for(None)
    for module in ROUTERS:
        app.include_router(module.router)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, settings=settings)
    if settings.cors_origins:  # added last, so it is outermost and answers preflights itself
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
