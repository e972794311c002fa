"""How every Switchboard process serves HTTP: `serve()` (uvicorn under the guarded protocol, the
app's lifespan, SIGTERM/SIGINT as a graceful shutdown, TLS when configured). Called by the `main()`
of the gateway, shard, vLLM sidecar, cache node and control plane.

    serve(app, host="127.0.0.1", port=8101)                               # blocks until SIGTERM
    serve(app, host=h, port=p, graceful_s=settings.shutdown_grace_s, on_shutdown=registry.close_waiters)

The protocol (`GuardedHttpProtocol`) is uvicorn's httptools protocol plus the slow-client bounds
(data_plane/common/slow_clients.py: the table of what each stops, and the SWITCHBOARD_HTTP_*
variables): a deadline for a new connection's first request, for a request head (headers trickled a
byte at a time), for a body that never finishes, and for a response the client stops reading; and
a bound on the connections open at once, below the open-file limit (a 503 beyond, never EMFILE).
Each cut is counted in ``switchboard_<process>_slow_clients_total{reason}`` of the registry given to
`serve()` and logged (never the request's content).

uvicorn arms its keep-alive timer only after a first response (Kludex/uvicorn#1192), so a
client that connects and never sends a byte held a connection forever: the cheapest slowloris.
A body that stops arriving altogether is answered sooner by the application (408, see
`data_plane.common.http_body.read_body`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any, ClassVar

import uvicorn
from prometheus_client import CollectorRegistry
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from data_plane.common.slow_clients import (
    HttpLimits,
    SlowClient,
    SlowClientMetrics,
    connection_ceiling,
    raise_fd_limit,
)
from data_plane.common.tls import TlsConfig

log = logging.getLogger(__name__)

FIRST_REQUEST_TIMEOUT_S = HttpLimits.first_request_s
LINGER_S = 2.0
"""After a 408, how long a cut connection's late bytes are read and dropped before it is closed."""

_TIMEOUT_BODY = json.dumps({"error": {"message": "the request did not arrive in time (slow client)",
                                      "type": "invalid_request_error", "param": None,
                                      "code": "request_timeout"}}).encode()
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)
_TOO_LARGE_BODY = json.dumps({"error": {"message": "the request's headers are too large",
                                        "type": "invalid_request_error", "param": None,
                                        "code": "request_header_fields_too_large"}}).encode()
_BUSY_BODY = json.dumps({"error": {"message": "the server holds as many connections as it can; retry shortly",
                                   "type": "server_error", "param": None, "code": "overloaded"}}).encode()
_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
             b"connection: close\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)
BUSY_LINGER_S = 0.5
"""A refused connection's lingering close: shorter than a 408's, its descriptor is wanted back."""
_MALFORMED_BODY = json.dumps({"error": {"message": "Invalid HTTP request received.", "type": "invalid_request_error",
                                        "param": None, "code": None}}).encode()
_MALFORMED_400 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                  b"content-length: " + str(len(_MALFORMED_BODY)).encode() + b"\r\n\r\n" + _MALFORMED_BODY)
_TOO_LARGE_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                  b"connection: close\r\ncontent-length: " + str(len(_TOO_LARGE_BODY)).encode() + b"\r\n\r\n"
                  + _TOO_LARGE_BODY)


class HeadTooLarge(Exception):
    """Raised inside httptools' callbacks to stop parsing a head past the bound."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the slow-client bounds of data_plane/common/slow_clients.py:
    one timer per connection phase (first request, head, body, a blocked write)."""

    limits = HttpLimits()
    on_cut: Callable[[SlowClient], None] | None = None
    """Counts a cut connection (set by `serve()` from the process's metrics registry)."""
    max_connections = 0
    """Connections open at once beyond which a new one is answered 503 (0: no bound)."""
    connection_ceiling = 0
    """Beyond it a refused connection is closed at once, without a lingering close (0: never)."""
    open_connections: ClassVar[list[int]] = [0]
    """Connections open now, one cell per server (`guarded_protocol` gives each its own)."""
    on_open: Callable[[int], None] | None = None

    @property
    def first_request_timeout_s(self) -> float:
        return self.limits.first_request_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timers: dict[SlowClient, asyncio.TimerHandle] = {}
        self._head_bytes = 0
        """Bytes of the reads in a row that stayed within a head or a trailer section (`_unbounded`)."""
        self._in_head = True
        self._chunk_open = False
        """A chunk's size line was read and none of its data yet: the last chunk's trailers come now."""
        self._progress = 0
        """Body pieces and messages completed: a read that moved it was not all head or trailers."""
        self._message_head = 0
        """Bytes of the message's request line target, headers and trailers handed over so far (`_count`)."""
        self._too_large = False
        self._opened(1)
        if self.max_connections and self.open_connections[0] > self.max_connections:
            if self.on_cut is not None:
                self.on_cut(SlowClient.TOO_MANY_CONNECTIONS)
            self.transport.write(_BUSY_503)
            if self.connection_ceiling and self.open_connections[0] > self.connection_ceiling:
                self._lingering = True
                self.transport.close()  # a burst: the descriptors are needed back now
            else:
                self._linger(BUSY_LINGER_S)
            return
        if self.limits.send_buffer_bytes:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        self._arm(SlowClient.FIRST_REQUEST, self.first_request_timeout_s)

    def _opened(self, delta: int) -> None:
        self.open_connections[0] += delta
        if self.on_open is not None:
            self.on_open(self.open_connections[0])

    def on_message_begin(self) -> None:
        self._disarm(SlowClient.FIRST_REQUEST)
        self._arm(SlowClient.HEADERS, self.limits.headers_s)
        self._message_head = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        """A head (or trailers) whose last read also completed it was never counted by `data_received`: one
        sent at once (100 KB in one write) got a 200. What httptools hands over counts too; past the bound
        the parse stops here (httptools raises, uvicorn calls `send_400_response`: the 431 instead)."""
        self._message_head += size
        if self.limits.max_head_bytes and self._message_head > self.limits.max_head_bytes:
            self._too_large = True
            raise HeadTooLarge

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm(SlowClient.HEADERS)
        self._arm(SlowClient.BODY, self.limits.body_s)
        super().on_headers_complete()

    def on_chunk_header(self) -> None:
        self._chunk_open = True

    def on_chunk_complete(self) -> None:
        self._chunk_open = False

    def on_body(self, body: bytes) -> None:
        self._chunk_open = False
        self._progress += 1
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head, self._chunk_open = True, False  # the next request's head (keep-alive) starts here
        self._progress += 1
        self._disarm(SlowClient.BODY)
        super().on_message_complete()

    def pause_writing(self) -> None:
        self._arm(SlowClient.STALLED_READER, self.limits.write_stall_s)
        super().pause_writing()

    def resume_writing(self) -> None:
        self._disarm(SlowClient.STALLED_READER)
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in getattr(self, "_timers", {}).values():
            timer.cancel()
        self._timers = {}
        self._opened(-1)
        super().connection_lost(exc)

    def _arm(self, reason: SlowClient, after_s: float) -> None:
        self._disarm(reason)
        if after_s > 0:
            self._timers[reason] = self.loop.call_later(after_s, self._expired, reason)

    def _disarm(self, reason: SlowClient) -> None:
        timer = getattr(self, "_timers", {}).pop(reason, None)
        if timer is not None:
            timer.cancel()

    def _expired(self, reason: SlowClient) -> None:
        self._timers.pop(reason, None)
        if self.transport.is_closing():
            return
        if reason in (SlowClient.HEADERS, SlowClient.BODY) and self.flow.read_paused:
            # we stopped reading (a pipelined request waits, or the app has not read its body yet): not the client
            self._arm(reason, self.limits.headers_s if reason is SlowClient.HEADERS else self.limits.body_s)
            return
        if self.on_cut is not None:
            self.on_cut(reason)
        log.info("closing a slow client's connection (%s) from %s", reason.value, self.client)
        if reason is SlowClient.STALLED_READER:
            self.transport.abort()  # what is buffered for it would never be read
            return
        if reason is SlowClient.HEADERS or (reason is SlowClient.BODY and not self._response_started()):
            self.transport.write(_TIMEOUT_408)
        self._linger()

    def _linger(self, after_s: float = LINGER_S) -> None:
        # A lingering close (nginx's lingering_close): the client is still sending, and closing now
        # would answer its next bytes with a reset that can destroy the 408 before it is read.
        self._lingering = True
        if self.cycle is not None:  # the app sees its client gone now (its sends become no-ops)
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(after_s, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if getattr(self, "_lingering", False):
            return  # cut: what still arrives is dropped
        before, progress = self._unbounded(), self._progress
        super().data_received(data)
        # httptools keeps a head, and a chunked body's trailers, whole however large: the reads that began
        # and ended inside one without a byte of body (those holding the end of a body or of a message,
        # one read at most each time, are not counted: a legal head or trailers just after a body is never
        # taken for a large one) add up, and past the bound the connection is refused
        if before and self._unbounded() and progress == self._progress:
            self._head_bytes += len(data)
        else:
            self._head_bytes = 0
        if (self._too_large or self.limits.max_head_bytes and self._head_bytes > self.limits.max_head_bytes) \
                and not self.transport.is_closing() and not getattr(self, "_lingering", False):
            for reason in (SlowClient.FIRST_REQUEST, SlowClient.HEADERS):
                self._disarm(reason)
            if self.on_cut is not None:
                self.on_cut(SlowClient.HEAD_TOO_LARGE)
            log.info("closing a connection whose request head passed %d bytes from %s", self.limits.max_head_bytes,
                     self.client)
            self.transport.write(_TOO_LARGE_431)
            self._linger()

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (a control character in a header value, a broken request line):
        uvicorn answers text/plain; every other answer of ours, this one too, is OpenAI's JSON error."""
        if self._too_large:  # the parse was stopped by `_count`: data_received answers 431
            return
        self.transport.write(_MALFORMED_400)
        self.transport.close()

    def _unbounded(self) -> bool:
        """In a request head, or in a chunked body's trailer section (or a chunk's size line)."""
        return self._in_head or self._chunk_open

    def _response_started(self) -> bool:
        cycle = self.cycle
        return cycle is not None and bool(cycle.response_started)


class ShutdownClock:
    """When this process's server began to stop and its grace: tells a request the server itself cancelled
    past the grace (uvicorn cancels every task still running then) from one whose client left."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.grace_s = math.inf

    def begin(self, grace_s: float | None) -> None:
        self.started = time.monotonic()
        self.grace_s = math.inf if grace_s is None else float(grace_s)

    def past_grace(self) -> bool:
        return self.started is not None and time.monotonic() - self.started >= self.grace_s


SHUTDOWN = ShutdownClock()
"""This process's: `serve` starts it as shutdown begins (one server per process)."""
SHUTDOWN_CUT = "shutdown_cut"
"""The reason (span error.type) of a request the process's own shutdown cancelled past the grace."""


class _ShutdownCutFilter(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for a request cancelled because it outlived
    the shutdown grace: uvicorn has already said once how many it cancelled, and the app logs each one as one
    line with its reason (a shard's stream: data_plane/shard/app.py). The cancellation itself is untouched
    (the task ends cancelled, the connection is cut, so a gateway still sees the break and resumes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) and SHUTDOWN.past_grace())


class _Server(uvicorn.Server):
    """uvicorn, plus hooks run the moment shutdown starts (before in-flight requests are waited
    for): e.g. a registry answering its blocking queries at once instead of after their wait."""

    def __init__(self, config: uvicorn.Config, on_shutdown: tuple[Callable[[], None], ...]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        # uvicorn waits the grace after a 0.1 s pause, then cancels: past_grace() is true by then
        SHUTDOWN.begin(self.config.timeout_graceful_shutdown)
        for hook in self._on_shutdown:
            hook()
        await super().shutdown(sockets)


def guarded_protocol(limits: HttpLimits, registry: CollectorRegistry | None = None,
                     process: str = "gateway") -> type[GuardedHttpProtocol]:
    """The protocol class for one server: its limits, its connections bounded and counted, and its cuts
    counted in `registry`."""
    metrics = SlowClientMetrics(registry, process) if registry is not None else None
    bound = limits.connections()
    ceiling = connection_ceiling(bound)
    if metrics is not None:
        metrics.bound.set(bound)
    attrs: dict[str, Any] = {"limits": limits, "on_cut": metrics.record if metrics is not None else None,
                             "max_connections": bound, "connection_ceiling": ceiling, "open_connections": [0],
                             "on_open": metrics.open.set if metrics is not None else None}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), attrs)


def serve(app: Any, *, host: str, port: int, graceful_s: int = 5, access_log: bool = False,
          on_shutdown: Callable[[], None] | tuple[Callable[[], None], ...] = (),
          registry: CollectorRegistry | None = None, process: str = "gateway") -> None:
    """Serve `app` on host:port until SIGTERM/SIGINT, then give in-flight requests `graceful_s`
    seconds and run the lifespan's shutdown. Logging stays as the process configured it
    (`configure_process`): uvicorn's start/stop lines at INFO, no access log unless `access_log`.
    TLS from the environment (data_plane/common/tls.py); slow-client bounds from the environment too,
    their cuts counted in `registry` (the one the app's /metrics shows)."""
    hooks = (on_shutdown,) if callable(on_shutdown) else tuple(on_shutdown)
    before, after = raise_fd_limit()
    if after != before:
        log.info("open files: soft limit raised from %d to %d (the hard limit)", before, after)
    protocol = guarded_protocol(HttpLimits.from_env(), registry, process)
    # proxy_headers off: uvicorn's default believes X-Forwarded-For from 127.0.0.1, so any local client
    # could name its own address; the gateway's --trusted-proxies decides (data_plane/gateway/client_address.py)
    config = uvicorn.Config(app, host=host, port=port, http=protocol, lifespan="on", proxy_headers=False,
                            access_log=access_log, log_config=None, timeout_graceful_shutdown=graceful_s,
                            **TlsConfig.from_env().uvicorn_kwargs())
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ShutdownCutFilter) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(_ShutdownCutFilter())
    sock = listen_socket(host, port, process)  # before the lifespan: no model load, no registration, then a bind error
    _Server(config, hooks).run(sockets=[sock])


COMMANDS = {"cache": "cache-node", "control_plane": "control-plane"}
"""`process` -> the `switchboard` subcommand that runs it, for the one line a bind failure prints."""


def listen_socket(host: str, port: int, process: str = "gateway") -> socket.socket:
    """The bound listening socket uvicorn would make (its Config.bind_socket), or exit in one line naming the
    address: a port already in use was uvicorn's ERROR line among the startup's, after the lifespan had loaded
    the model and registered the member, and exit code 3."""
    sock: socket.socket | None = None
    try:
        # uvicorn's choice of family: IPv6 for an address with a colon, else IPv4. The resolver's first answer
        # for "localhost" is ::1 on hosts with IPv6, which bound the server to ::1 alone (127.0.0.1 refused)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        family, _, _, _, address = socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:  # socket.gaierror too: a host that does not resolve
        if sock is not None:
            sock.close()
        held = " (another process holds it: stop it, or give this one another --port)" if (
            exc.errno == errno.EADDRINUSE) else ""
        raise SystemExit(f"switchboard {COMMANDS.get(process, process)}: cannot listen on {host}:{port}: "
                         f"{exc.strerror or exc}{held}") from None
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for child processes started on it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
