"""Bounds on slow clients (slowloris and its cousins), shared by every Switchboard server.

    limits = HttpLimits.from_env()                 # SWITCHBOARD_HTTP_* (below), else the defaults
    metrics = SlowClientMetrics(registry, "gateway")   # switchboard_gateway_slow_clients_total{reason}
    serve(app, host=h, port=p, registry=registry, process="gateway")   # http_server.py applies both

What each bound stops, and what the client sees (the protocol, ``GuardedHttpProtocol``, enforces
them on the connection, before and beside the application):

| reason | a client that ... | bound | answer |
|---|---|---|---|
| ``first_request`` | connects and never sends a byte | ``first_request_s`` | connection closed |
| ``headers`` | trickles its request head (a byte at a time) | ``headers_s`` from its first byte | 408, closed |
| ``body`` | sends a body that never finishes (however slowly it trickles) | ``body_s`` from the end of the head | 408 (when no response started), closed |
| ``stalled_reader`` | stops reading a response (a stream) | ``write_stall_s`` with the server's writes blocked | connection aborted |
| ``head_too_large`` | sends a request head (request line and headers), or a chunked body's trailers, past a size | ``max_head_bytes`` | 431, closed |
| ``too_many_connections`` | one of more connections open at once than the process can hold (thousands of idle keep-alives, slow readers) | ``max_connections`` | 503 with Retry-After, closed |

Open connections are bounded below the process's open-file limit (`serve()` first raises its soft
limit to the hard one, as Go's runtime and nginx's ``worker_rlimit_nofile`` do): beyond the bound a
new connection is answered 503 at once, while the process keeps the descriptors its own work needs
(hops to shards and cache nodes, the usage spool, the ledger database). Without it, a flood of idle
connections took every descriptor: clients got connection resets, the gateway's hops failed with
EMFILE (503 "no cache replica answered", a shard ejected for the gateway's own fault) and its usage
records could not be spooled.

httptools keeps a head however large (uvicorn's h11 protocol stops at 16 KiB; httptools has no bound):
before ``max_head_bytes``, one connection sent 200 MB of headers within ``headers_s`` and the gateway's
memory grew by as much, with no API key (many such: the process killed for memory, every tenant down).

The application's own body reader (data_plane/common/http_body.py) answers 408 sooner to a body
that stops arriving altogether (30 s between chunks); the protocol's ``body_s`` bounds the body
that keeps arriving too slowly to finish. A closed or aborted connection reaches the application
as a client disconnect, so the gateway aborts the generation and frees its admission slot, and the
shard its sequence (the same path as a client that hangs up).

Counted in ``switchboard_<process>_slow_clients_total{reason}``; beside it, the process's
``switchboard_<process>_asyncio_tasks`` (tasks not done at the scrape, for leak checks: the soak).

Environment (each a named constant; 0 switches a bound off, not recommended): see ``ENV_*``.
"""

from __future__ import annotations

import asyncio
import enum
import os
import resource
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

ENV_FIRST_REQUEST_S = "SWITCHBOARD_HTTP_FIRST_REQUEST_TIMEOUT_S"
ENV_HEADERS_S = "SWITCHBOARD_HTTP_HEADERS_TIMEOUT_S"
ENV_BODY_S = "SWITCHBOARD_HTTP_BODY_TIMEOUT_S"
ENV_WRITE_STALL_S = "SWITCHBOARD_HTTP_WRITE_STALL_TIMEOUT_S"
ENV_MAX_HEAD_BYTES = "SWITCHBOARD_HTTP_MAX_HEAD_BYTES"
ENV_SEND_BUFFER_BYTES = "SWITCHBOARD_HTTP_SEND_BUFFER_BYTES"
ENV_MAX_CONNECTIONS = "SWITCHBOARD_HTTP_MAX_CONNECTIONS"
"""Open connections at once; 0 (default) = from the open-file limit (:func:`connection_bound`)."""
"""Kernel send buffer per accepted connection (SO_SNDBUF); 0 = the kernel's autotuning (default).
A smaller one finds a reader that stopped sooner (the kernel otherwise absorbs ~1.7 MB on loopback)."""


class SlowClient(enum.Enum):
    """Why a connection was cut (the metric's label)."""

    FIRST_REQUEST = "first_request"
    HEADERS = "headers"
    BODY = "body"
    STALLED_READER = "stalled_reader"
    HEAD_TOO_LARGE = "head_too_large"
    TOO_MANY_CONNECTIONS = "too_many_connections"


@dataclass(frozen=True)
class HttpLimits:
    """Connection-level bounds (seconds, bytes); see the module docstring."""

    first_request_s: float = 10.0
    """A new connection's first request must start within this (G1)."""
    headers_s: float = 10.0
    """A request head must be complete this long after its first byte (nginx: client_header_timeout 60 s)."""
    body_s: float = 60.0
    """A request body must be complete this long after its head (Envoy: request_timeout)."""
    write_stall_s: float = 30.0
    """A response whose writes stay blocked (the client reads nothing) this long is cut."""
    send_buffer_bytes: int = 0
    """SO_SNDBUF per connection; 0 = the kernel's."""
    max_head_bytes: int = 64 * 1024
    """The largest request head (request line and headers) read (Envoy: 60 KiB; nginx: 4 lines of 8 KiB)."""
    max_connections: int = 0
    """Open connections at once (beyond: 503); 0 = :func:`connection_bound` of the open-file limit."""

    def __post_init__(self) -> None:
        for name in ("first_request_s", "headers_s", "body_s", "write_stall_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.send_buffer_bytes < 0 or self.max_head_bytes < 0 or self.max_connections < 0:
            raise ValueError("send_buffer_bytes, max_head_bytes and max_connections must be >= 0")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> HttpLimits:
        env = dict(os.environ) if env is None else env
        d = cls()

        def num(key: str, default: float) -> float:
            raw = env.get(key)
            return float(raw) if raw not in (None, "") else default

        return cls(first_request_s=num(ENV_FIRST_REQUEST_S, d.first_request_s), headers_s=num(ENV_HEADERS_S, d.headers_s),
                   body_s=num(ENV_BODY_S, d.body_s), write_stall_s=num(ENV_WRITE_STALL_S, d.write_stall_s),
                   send_buffer_bytes=int(num(ENV_SEND_BUFFER_BYTES, d.send_buffer_bytes)),
                   max_head_bytes=int(num(ENV_MAX_HEAD_BYTES, d.max_head_bytes)),
                   max_connections=int(num(ENV_MAX_CONNECTIONS, d.max_connections)))

    def connections(self) -> int:
        """The bound in force: `max_connections`, or one from the open-file limit."""
        return self.max_connections or connection_bound()


FD_RESERVE_SHARE = 0.25
"""The share of the open-file limit kept for the process's own descriptors (at least FD_RESERVE_MIN)."""
FD_RESERVE_MIN = 128


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft open-file limit to its hard limit; returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def connection_ceiling(bound: int, soft: int | None = None) -> int:
    """Connections past which a refused one is closed at once, its 503 written but not lingered over: half
    way from `bound` to the open-file limit (a burst of refused connections must not eat the reserve)."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(bound, bound + (soft - bound) // 2)


def connection_bound(soft: int | None = None) -> int:
    """Client connections a process may hold: its open-file limit less a reserve for its own work."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - max(FD_RESERVE_MIN, int(soft * FD_RESERVE_SHARE)))


PROCESSES = ("gateway", "shard", "cache", "control_plane")
"""The metric's prefix per process (metric names stay unique across processes)."""


class SlowClientMetrics:
    """``switchboard_<process>_slow_clients_total{reason}``: connections cut by a slow-client bound."""

    def __init__(self, registry: CollectorRegistry, process: str) -> None:
        if process not in PROCESSES:
            raise ValueError(f"process must be one of {PROCESSES}")
        self.cut = Counter(f"switchboard_{process}_slow_clients", "Connections cut by a slow-client bound, by reason "
                           "(first_request, headers, body, stalled_reader, head_too_large, too_many_connections).",
                           ["reason"], registry=registry)
        for reason in SlowClient:
            self.cut.labels(reason.value)
        self.open = Gauge(f"switchboard_{process}_open_connections", "Client connections open now.", registry=registry)
        self.bound = Gauge(f"switchboard_{process}_max_connections", "Client connections held at most (beyond: 503; "
                           "from the open-file limit unless SWITCHBOARD_HTTP_MAX_CONNECTIONS sets it).",
                           registry=registry)
        self.tasks = Gauge(f"switchboard_{process}_asyncio_tasks", "asyncio tasks not yet done in the process's event "
                           "loop, at the scrape (a task started per request or per object and never ended shows as "
                           "growth; the soak bounds it).", registry=registry)
        self.tasks.set_function(running_tasks)

    def record(self, reason: SlowClient) -> None:
        self.cut.labels(reason.value).inc()


def running_tasks() -> float:
    """The event loop's tasks not done yet, counted where /metrics is served (every process's route is
    async: its event loop's thread); NaN when read off that thread."""
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # no running loop in this thread
        return float("nan")


__all__ = [
    "ENV_BODY_S",
    "ENV_FIRST_REQUEST_S",
    "ENV_HEADERS_S",
    "ENV_MAX_CONNECTIONS",
    "ENV_MAX_HEAD_BYTES",
    "ENV_SEND_BUFFER_BYTES",
    "ENV_WRITE_STALL_S",
    "PROCESSES",
    "HttpLimits",
    "SlowClient",
    "SlowClientMetrics",
    "connection_bound",
    "connection_ceiling",
    "raise_fd_limit",
    "running_tasks",
]
