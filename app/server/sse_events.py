"""Server-sent events with event names (`event: NAME` + `data: {json}`), for the Responses and
Anthropic Messages streams; no `[DONE]` frame, and an error becomes the API's own error event.

As in `sse`, the event generator is always closed, so the engine stream under it is closed too
and the request aborted when the client leaves.
"""

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from localllm.app.server.errors import APIError, to_api_error
from localllm.app.server.sse import frame

Event = tuple[str, dict]


def named_frame(event: str, data: dict) -> bytes:
    return f"event: {event}\n".encode() + frame(data)


async def _frames(
    events: AsyncIterator[Event], on_error: Callable[[APIError], Event]
) -> AsyncIterator[bytes]:
    try:
        async for name, data in events:
            yield named_frame(name, data)
    except Exception as exc:  # headers are gone already: the error travels as the last event
        yield named_frame(*on_error(to_api_error(exc)))
    finally:
        await events.aclose()


def named_sse_response(
    events: AsyncIterator[Event], on_error: Callable[[APIError], Event]
) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        _frames(events, on_error), media_type="text/event-stream", headers=headers
    )
