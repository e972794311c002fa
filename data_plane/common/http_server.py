"""How every Switchboard process serves HTTP: `serve()` (uvicorn under the guarded protocol, the
app's lifespan, SIGTERM/SIGINT as a graceful shutdown, TLS when configured). Called by the `main()`
of the gateway, shard, vLLM sidecar, cache node and control plane.

    serve(app, host="127.0.0.1", port=8101)                               # blocks until SIGTERM
    serve(app, host=h, port=p, graceful_s=settings.shutdown_grace_s, on_shutdown=registry.close_waiters)

The protocol (`GuardedHttpProtocol`) is uvicorn's httptools protocol plus a deadline for a new
connection's first request.

uvicorn arms its keep-alive timer only after a first response (Kludex/uvicorn#1192), so a
client that connects and never sends a byte holds a connection forever: the cheapest
slowloris. Here a connection that has not started a request within
:data:`FIRST_REQUEST_TIMEOUT_S` is closed. A request whose headers arrived but whose body
stalls is handled by the application (408, see `data_plane.common.http_body.read_body`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from data_plane.common.tls import TlsConfig

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


class _Server(uvicorn.Server):
    """uvicorn, plus hooks run the moment shutdown starts (before in-flight requests are waited
    for): e.g. a registry answering its blocking queries at once instead of after their wait."""

    def __init__(self, config: uvicorn.Config, on_shutdown: tuple[Callable[[], None], ...]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        for hook in self._on_shutdown:
            hook()
        await super().shutdown(sockets)


def serve(app: Any, *, host: str, port: int, graceful_s: int = 5, access_log: bool = False,
          on_shutdown: Callable[[], None] | tuple[Callable[[], None], ...] = ()) -> None:
    """Serve `app` on host:port until SIGTERM/SIGINT, then give in-flight requests `graceful_s`
    seconds and run the lifespan's shutdown. Logging stays as the process configured it
    (`configure_process`): uvicorn's start/stop lines at INFO, no access log unless `access_log`.
    TLS from the environment (data_plane/common/tls.py)."""
    hooks = (on_shutdown,) if callable(on_shutdown) else tuple(on_shutdown)
    config = uvicorn.Config(app, host=host, port=port, http=GuardedHttpProtocol, lifespan="on",
                            access_log=access_log, log_config=None, timeout_graceful_shutdown=graceful_s,
                            **TlsConfig.from_env().uvicorn_kwargs())
    _Server(config, hooks).run()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for child processes started on it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
