"""The HTTP protocol every Switchboard server runs under uvicorn: uvicorn's httptools protocol,
plus a deadline for a new connection's first request.

    uvicorn.run(app, host=h, port=p, http=GuardedHttpProtocol)

uvicorn arms its keep-alive timer only after a first response (Kludex/uvicorn#1192), so a
client that connects and never sends a byte holds a connection forever: the cheapest
slowloris. Here a connection that has not started a request within
:data:`FIRST_REQUEST_TIMEOUT_S` is closed. A request whose headers arrived but whose body
stalls is handled by the application (408, see `data_plane.protocol.read_body`).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

FIRST_REQUEST_TIMEOUT_S = 10.0


class GuardedHttpProtocol(HttpToolsProtocol):
    first_request_timeout_s = FIRST_REQUEST_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._first_request_timer: asyncio.TimerHandle | None = self.loop.call_later(
            self.first_request_timeout_s, self._close_idle)

    def on_message_begin(self) -> None:
        self._cancel_first_request_timer()
        super().on_message_begin()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_first_request_timer()
        super().connection_lost(exc)

    def _cancel_first_request_timer(self) -> None:
        timer: Any = getattr(self, "_first_request_timer", None)
        if timer is not None:
            timer.cancel()
            self._first_request_timer = None

    def _close_idle(self) -> None:
        self._first_request_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for child processes started on it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
