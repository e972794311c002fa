"""The gateway's HTTP/1.1 client for its internal hops: shards (a streamed chat completion per
request) and cache nodes (a session GET and PUTs per turn).

    pool = HopPool(connect_timeout_s=2.0)
    response = await pool.post("http://127.0.0.1:8101", "/v1/chat/completions", body, headers)
    if response.status != 200:
        error_body = await response.read()
    while lines := await response.lines():   # every complete line that has arrived, at once
        ...
    response.close()     # before the end: drops the connection, so the shard aborts the work
    session = await (await pool.request("GET", cache_url, "/v1/sessions/s1", timeout=1.0)).read()
    await pool.aclose()

These hops are on every request's path, so the client is built for them alone. httpx cost the
gateway ~1.5 ms of CPU per streamed completion (its pool, anyio and h11 layers run per body
chunk); here responses are parsed by httptools (the C parser uvicorn itself uses) inside an
asyncio protocol, and `lines()` hands over everything that has arrived in one call, so a burst
of tokens costs one wake-up and, in the gateway, one write to the client.

Connections are kept alive per host and reused (LIFO, expired after `keepalive_s` idle, below
uvicorn's 5 s server-side keep-alive). A reused connection that the server closed before
answering a single byte is the keep-alive race, not a failure: the request is sent again once
on a fresh connection. The read buffer is bounded: reading pauses while more than `HIGH_WATER`
bytes wait for a slow client (TCP backpressure reaches the server). Deadlines (`timeout=`) are
enforced by one sweep timer per pool, not a timer per wait.
"""

from __future__ import annotations

import asyncio
import collections
import encodings.idna  # noqa: F401 -- imported now: _target's "idna" codec loaded lazily needs a free descriptor (EMFILE)
import errno
import ssl
import time
from collections.abc import Callable
from typing import Self
from urllib.parse import urlsplit

import httptools

HOP_EVENTS = ("opened", "reused", "stale_retry", "timeout", "connect_error")
"""What `HopPool(on_event=...)` reports (the gateway counts them)."""
SWEEP_S = 0.1
"""How often deadlines are checked: one timer per pool, not one per wait (an `asyncio.timeout`
per batch of tokens cost more than parsing the batch)."""
HIGH_WATER = 256 * 1024
"""Buffered response bytes above which reading from the server pauses."""
MAX_READ_BYTES = 8 * 1024 * 1024
"""`read()` refuses a larger body (a shard's or cache node's answer is far smaller)."""


class HopError(Exception):
    """Any failure on an internal hop."""


class HopConnectError(HopError):
    """The TCP connection could not be made (refused, unreachable, timed out)."""


class HopLocalError(HopError):
    """This process could not open the connection (out of file descriptors, socket buffers or memory):
    not the peer's failure, so it must not count against it (a shard ejected, a cache node skipped)."""


LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class HopDisconnected(HopError):
    """The server closed the connection before the response was complete."""


class HopTimeout(HopError):
    """The server said nothing before the deadline; the connection was dropped."""


class HopProtocolError(HopError):
    """The server's bytes are not valid HTTP/1.1 (or a body is too large)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, pool: HopPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.got_bytes = False
        self.buffer = bytearray()
        self.error: HopError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.deadline = 0.0
        """Loop time by which the current wait must end (0: none); enforced by the pool's sweep."""
        self.paused = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(HopProtocolError("the server tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(HopProtocolError(f"the server sent invalid HTTP: {exc}"))
        if len(self.buffer) > HIGH_WATER and not self.paused and not self.complete and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if not self.complete and self.error is None:
            if self.headers_done and not self._framed():
                self.complete = True  # a close-delimited body ends with the connection
            else:
                self.error = HopDisconnected("the server closed the connection mid-response" if self.got_bytes
                                               else "the server closed the connection without answering")
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message ends
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.buffer += body

    def on_message_complete(self) -> None:
        self.complete = True

    # -- used by HopResponse / HopPool ----------------------------------------------------

    def _framed(self) -> bool:
        return any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers)

    def _fail(self, error: HopError) -> None:
        if self.error is None:
            self.error = error
        self.abort()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, deadline: float = 0.0) -> None:
        """Until more bytes, the end of the response, a failure, or `deadline` (loop time; 0 for
        none), when the connection fails with HopTimeout."""
        self.waiter = self.pool._loop().create_future()
        self.deadline = deadline
        if deadline:
            self.pool._watch(self)
        try:
            await self.waiter
        finally:
            self.waiter = None
            self.deadline = 0.0

    def resume(self, whole_body: bool = False) -> None:
        """Read again once the consumer caught up (or at once when it wants the whole body, which
        `read()` bounds by its own limit)."""
        if self.paused and (whole_body or len(self.buffer) <= HIGH_WATER // 2) and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        if self.paused:  # a reused connection must read again, whatever the last response left
            self.transport.resume_reading()
        self._begin()
        self.transport.write(request)

    def expire(self) -> None:
        self._fail(HopTimeout("the server sent nothing in time"))
        self._wake()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()  # no FIN-wait on a half-read stream: the server sees the reset now

    def reusable(self) -> bool:
        return not self.closed and self.complete and self.error is None and not self.buffer and self.keep_alive


class HopResponse:
    """A response whose status and headers have arrived; the body is read on demand."""

    def __init__(self, pool: HopPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n == name:
                return v
        return None

    async def read(self, deadline: float = 0.0, limit: int = MAX_READ_BYTES) -> bytes:
        """The whole body (for errors and non-streaming answers); releases the connection.
        `deadline`: loop time for the whole body (0: none); more than `limit` bytes is an error."""
        conn = self._conn
        if conn is None:
            raise HopError("the response is closed")
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            if len(conn.buffer) > limit:
                conn.abort()
                raise HopProtocolError(f"a response exceeds {limit} bytes")
            conn.resume(whole_body=True)
            await conn.wait(deadline)
        body = bytes(conn.buffer)
        conn.buffer.clear()
        self.close()
        return body

    async def lines(self, timeout: float = 0.0) -> list[bytes]:
        """Every complete, non-empty line received so far (waiting for at least one, for at most
        `timeout` seconds if given); `[]` once the body has ended. Raises HopError if the
        stream breaks (HopTimeout if it stays silent)."""
        conn = self._conn
        if conn is None:
            return []
        while True:
            buf = conn.buffer
            end = buf.rfind(b"\n")
            if end >= 0:
                chunk = bytes(buf[:end + 1])
                del buf[:end + 1]
                conn.resume()
                lines = [line.rstrip(b"\r") for line in chunk.split(b"\n") if line and line != b"\r"]
                if lines:
                    return lines
                continue
            if conn.complete:
                rest = bytes(buf).strip()
                buf.clear()
                return [rest] if rest else []
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._pool._loop().time() + timeout if timeout else 0.0)

    @property
    def complete(self) -> bool:
        return self._conn is None or (self._conn.complete and not self._conn.buffer)

    def fail(self, error: HopError) -> None:
        """Break the response now: a reader waiting in `lines()`/`read()` gets `error` (e.g. the
        server left membership while streaming). Idempotent; `close()` still releases it."""
        conn = self._conn
        if conn is not None and not conn.complete:
            conn._fail(error)
            conn._wake()

    def close(self) -> None:
        """Back to the pool if the response was read to its end, else the connection is dropped
        (which is how a shard learns that nobody wants the rest). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable():
            self._pool._release(conn)
        else:
            conn.abort()


class HopPool:
    """Keep-alive connections to shards and cache nodes, by host and port."""

    def __init__(self, connect_timeout_s: float = 2.0, keepalive_s: float = 4.0, max_idle_per_host: int = 64,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._on_event = on_event or (lambda event: None)
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._tls: set[tuple[str, int]] = set()
        """Targets reached over TLS (``https://`` members), verified with `ssl.create_default_context()`
        (the CA bundle in SSL_CERT_FILE, data_plane/common/tls.py)."""
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self._watched: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
                   timeout: float = 0.0) -> HopResponse:
        """`request("POST", ...)` with a JSON body."""
        return await self.request("POST", base_url, path, body, headers, timeout)

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, timeout: float = 0.0) -> HopResponse:
        """Send the request (a non-empty `body` goes as JSON) to `base_url + path`; returns once the
        status and headers arrived, raising HopTimeout if they do not within `timeout` seconds
        (0: no limit). Cancelling it also gives up: the connection is dropped."""
        host, port, host_header = self._target(base_url)
        head = [method.encode("ascii"), b" ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", host_header]
        if body or method in ("POST", "PUT", "PATCH"):
            head += [b"\r\ncontent-type: application/json\r\ncontent-length: ", str(len(body)).encode()]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"invalid header {name!r}")
            head += [b"\r\n", name.encode("latin-1"), b": ", value.encode("latin-1")]
        request = b"".join(head) + b"\r\n\r\n" + body
        deadline = self._loop().time() + timeout if timeout else 0.0
        for _ in range(2):
            conn = self._take((host, port))
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port, (host, port) in self._tls)
                self._on_event("opened")
            else:
                self._on_event("reused")
            try:
                conn.send(request)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(deadline)
            except HopDisconnected:
                conn.abort()
                if reused and not conn.got_bytes:
                    self._on_event("stale_retry")
                    continue  # the keep-alive race: the server closed it as we sent; once more, fresh
                raise
            except BaseException:
                conn.abort()
                raise
            return HopResponse(self, conn)
        raise HopDisconnected("the server closed two connections without answering")

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self._event_loop
        if loop is None:
            loop = self._event_loop = asyncio.get_running_loop()
        return loop

    def _watch(self, conn: _Connection) -> None:
        self._watched.add(conn)
        if self._sweeper is None:
            self._sweeper = self._loop().call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Fail the waits past their deadline; re-arm while any wait has one."""
        self._sweeper = None
        now = self._loop().time()
        for conn in list(self._watched):
            if conn.waiter is None or not conn.deadline:
                self._watched.discard(conn)
            elif now >= conn.deadline:
                self._watched.discard(conn)
                self._on_event("timeout")
                conn.expire()
        if self._watched:
            self._sweeper = self._loop().call_later(SWEEP_S, self._sweep)

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise HopConnectError(f"unsupported URL {base_url!r} (http(s)://host:port expected)")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            target = (parts.hostname, port, f"{parts.hostname}:{port}".encode("idna"))
            if parts.scheme == "https":
                self._tls.add((parts.hostname, port))
            if len(self._targets) > 4096:
                self._targets.clear()
            self._targets[base_url] = target
        return target

    async def _connect(self, host: str, port: int, tls: bool = False) -> _Connection:
        if self._closed:
            raise HopConnectError("the pool is closed")
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()  # verifies the peer against SSL_CERT_FILE / system CAs
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, (host, port)), host, port,
                                                       ssl=self._ssl if tls else None,
                                                       server_hostname=host if tls else None)
        except TimeoutError:
            self._on_event("connect_error")
            raise HopConnectError(f"connecting to {host}:{port} timed out") from None
        except ssl.SSLError as exc:  # an unverified peer, or a plain-HTTP one: refused
            self._on_event("connect_error")
            raise HopConnectError(f"TLS with {host}:{port} failed: {exc.reason or exc}") from None
        except OSError as exc:
            self._on_event("connect_error")
            if exc.errno in LOCAL_ERRNOS:
                raise HopLocalError(f"cannot open a connection to {host}:{port} here: {exc.strerror or exc}") from None
            raise HopConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return conn

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        cutoff = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()  # newest first: the warmest, least likely to have been closed
            if conn.closed:
                continue
            if conn.idle_since < cutoff:
                conn.abort()
                continue
            return conn
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, collections.deque())
        if self._closed or len(idle) >= self.max_idle_per_host:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle:
            try:
                idle.remove(conn)
            except ValueError:
                pass

    def idle_connections(self) -> int:
        return sum(len(q) for q in self._idle.values())

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()
        self._idle.clear()
