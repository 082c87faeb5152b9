"""The HTTP connection itself: how long a client may take to send a request's headers.

uvicorn times out idle keep-alive connections but not a request whose headers trickle in: a
client that sends half a request line and stops holds its connection (and a slot under
`--max-connections`) forever. `protocol_class` adds that deadline to uvicorn's own protocol
(h11, or httptools where installed): the headers must be complete within `read_timeout` seconds
of the connection opening or of the previous response ending, else the connection is closed.
The body's deadline is the guard middleware's (it reads the body).
"""

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderDeadline:
    """Mixin over a uvicorn HTTP protocol class; see the module docstring."""

    read_timeout: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._in_request():  # the headers are complete: the app has the request now
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self._arm()  # the next request on this connection gets the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _in_request(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        loop: asyncio.AbstractEventLoop = self.loop  # type: ignore[attr-defined]
        self._deadline = loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self._in_request():
            self.transport.close()  # type: ignore[attr-defined]


def protocol_class(read_timeout: float, parser: str = "auto") -> type:
    """uvicorn's HTTP protocol with the header deadline; pass it as `http=`. `parser`: "auto"
    (httptools where installed, else h11), "h11" or "httptools"."""
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        base = H11Protocol if parser == "h11" else AutoHTTPProtocol
    return type(f"Deadline{base.__name__}", (_HeaderDeadline, base), {"read_timeout": read_timeout})
