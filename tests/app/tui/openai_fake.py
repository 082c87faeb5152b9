"""A scripted OpenAI-compatible server on a real socket (uvicorn in a thread) for endpoint tests.

`/v1/models` lists one model; `/v1/chat/completions` streams the scripted deltas as SSE chunks
(`{"reasoning_content": ...}` or `{"content": ...}`), then a usage chunk and `[DONE]`. With
`hold_after=N` the stream pauses after N deltas until `release` is set or the client goes away
(`disconnected` is then set), which is how a test quits or stops mid-answer.
"""

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "fake-reasoner"
CONTEXT = 4096


class FakeOpenAI:
    def __init__(
        self,
        deltas: list[dict[str, str]],
        finish: str = "stop",
        hold_after: int | None = None,
    ):
        self.deltas, self.finish, self.hold_after = deltas, finish, hold_after
        self.requests: list[dict] = []  # the JSON body of every chat request
        self.release = threading.Event()
        self.disconnected = threading.Event()
        self.url = ""

    def app(self) -> Starlette:
        async def models(_: Request) -> JSONResponse:
            card = {"id": MODEL, "object": "model", "max_model_len": CONTEXT}
            return JSONResponse({"object": "list", "data": [card]})

        async def chat(request: Request) -> StreamingResponse:
            self.requests.append(await request.json())
            return StreamingResponse(self._events(), media_type="text/event-stream")

        routes = [
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
        return Starlette(routes=routes)

    async def _events(self):
        try:
            for i, delta in enumerate(self.deltas):
                if i == self.hold_after:
                    while not self.release.is_set():
                        await asyncio.sleep(0.01)
                yield _sse({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": self.finish}]})
            n = len(self.deltas)
            yield _sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n}})
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # Starlette saw the client go away
            self.disconnected.set()
            raise


def _sse(chunk: dict) -> str:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, **chunk}
    return f"data: {json.dumps(chunk)}\n\n"


@contextmanager
def serving(fake: FakeOpenAI) -> Iterator[FakeOpenAI]:
    """Serve `fake` on 127.0.0.1 (a free port) for the duration of the block."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        fake.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield fake
    finally:
        fake.release.set()
        server.should_exit = True
        thread.join(10)
        sock.close()
