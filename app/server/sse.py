"""Server-sent events: `data: {json}\\n\\n` frames, `data: [DONE]`, errors as a final frame.

The event generator is closed whatever happens to the connection, so the engine stream under it
is closed too and the request aborted (starlette cancels the sender when the client leaves).
"""

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from localllm.app.server.errors import error_body, to_api_error

DONE = b"data: [DONE]\n\n"


def frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _events(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield frame(chunk)
    except Exception as exc:  # headers are gone already: the error travels as the last event
        e = to_api_error(exc)
        yield frame(error_body(e.status, e.message, e.param, e.code))
    finally:
        await chunks.aclose()
    yield DONE


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_events(chunks), media_type="text/event-stream", headers=headers)
