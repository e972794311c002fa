"""The shard's KV-block client: places, stores and fetches a session's KV blocks on the cache nodes.

    remote = KVRemote(membership, httpx.AsyncClient(), zone="a", headers={"Authorization": "Bearer …"})
    acks = await remote.store("sess-1", replicas=2, links=[h0], frames=[f1, f2], ttl_s=86400)
    got = await remote.fetch("sess-1", replicas=2, hashes=[h0, h1, h2], skip=1)   # Fetched | None

Placement is the transcript's (data_plane/cache/client.py): the healthy ``cache`` members form a
:class:`~data_plane.membership.hashring.HashRing` keyed by session id, ``replicas`` nodes are taken
along its walk one per zone first (data_plane/membership/placement.py), and fetches ask the local
zone's copy first. So a session's blocks sit on the nodes that hold its transcript, replicated as
its tier says, and any shard finds them from membership alone. The wire format is
data_plane/kv_wire.py; the node's side data_plane/cache/kv_routes.py.

Failures never raise: a node that is down, slow or answers an error is skipped (logged, counted by
the caller), and a fetch that no node answers is None (the shard recomputes).

Fetches, which sit on the request path and carry tens of MB, go over a bare HTTP/1.1 exchange on
an asyncio stream (:func:`post_raw`, TLS through ``ssl.create_default_context()`` like the hop
client) rather than httpx: measured on loopback here, a 30 MB body took 191 ms through httpx and
59 ms read with ``readexactly`` (curl: 39-53 ms). Stores, off the request path, use httpx.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
from opentelemetry import propagate

from data_plane.kv_wire import CONTENT_TYPE, encode_put
from data_plane.membership.hashring import DEFAULT_VNODES, HashRing
from data_plane.membership.placement import DEFAULT_ZONE, local_first, replicas_across_zones

if TYPE_CHECKING:
    from data_plane.membership.view import Member, MembershipView

log = logging.getLogger(__name__)

CACHE_SERVICE = "cache"
SUSPECT_S = 5.0
"""A node a fetch could not reach is skipped by fetches for this long (a stopped node would otherwise
cost every resumed turn a timeout); stores still try it."""
MAX_FETCH_BODY = 1 << 30
"""A fetch answer larger than this is refused (a node that misbehaves cannot exhaust memory)."""


class RawHTTPError(Exception):
    pass


async def post_raw(url: str, path: str, body: bytes, headers: Mapping[str, str],
                   timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """POST `body` and read the whole answer: (status, lower-cased headers, body). One connection
    per call (``connection: close``). Raises RawHTTPError, OSError or TimeoutError."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ssl.create_default_context() if tls else None, server_hostname=host if tls else None)
        try:
            lines = [f"POST {path} HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(body)}",
                     "connection: close", *(f"{k}: {v}" for k, v in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            try:
                status = int(status_line.split(" ", 2)[1])
            except (IndexError, ValueError):
                raise RawHTTPError(f"bad status line {status_line[:40]!r}") from None
            got = {}
            for line in header_lines:
                name, sep, value = line.partition(":")
                if sep:
                    got[name.strip().lower()] = value.strip()
            if "chunked" in got.get("transfer-encoding", "").lower():
                raise RawHTTPError("chunked answers are not expected from a cache node")
            length = got.get("content-length")
            if length is not None:
                if not length.isdigit() or int(length) > MAX_FETCH_BODY:
                    raise RawHTTPError("bad content-length")
                data = await reader.readexactly(int(length))
            else:
                data = await reader.read(MAX_FETCH_BODY)
            return status, got, data
        finally:
            writer.close()


@dataclass(frozen=True)
class Fetched:
    run: int
    """Leading blocks of the asked hashes the node holds (the skipped ones included)."""
    body: bytes
    """Frames of blocks ``skip..run`` back to back."""
    node: str
    seconds: float


class KVRemote:
    def __init__(self, membership: MembershipView, http: httpx.AsyncClient, *, zone: str = DEFAULT_ZONE,
                 headers: Mapping[str, str] | None = None, timeout_s: float = 2.0, vnodes: int = DEFAULT_VNODES,
                 service: str = CACHE_SERVICE) -> None:
        self._membership = membership
        self._http = http
        self._zone = zone
        self._headers = dict(headers or {})
        self._timeout_s = timeout_s
        self._vnodes = vnodes
        self._service = service
        self._key: tuple[tuple[str, str, str], ...] = ()
        self._ring = HashRing(())
        self._by_id: dict[str, Member] = {}
        self._zone_of: dict[str, str] = {}
        self._suspect_until: dict[str, float] = {}

    def replicas_for(self, session_id: str, replicas: int) -> list[Member]:
        """The cache members that hold `session_id`'s blocks now, local zone first ([] if none)."""
        members = self._membership.members(self._service)
        key = tuple((m.id, m.url, m.zone) for m in members)
        if key != self._key:
            self._key = key
            self._ring = HashRing((m.id for m in members), self._vnodes)
            self._by_id = {m.id: m for m in members}
            self._zone_of = {m.id: m.zone for m in members}
        if not members:
            return []
        ids = replicas_across_zones(self._ring.walk(session_id), max(1, replicas), self._zone_of, local=self._zone)
        return [self._by_id[i] for i in local_first(ids, self._zone_of, self._zone)]

    @staticmethod
    def _traced(headers: dict[str, str]) -> dict[str, str]:
        """`headers` with the current trace's `traceparent`: a turn's fetch shows on the cache node in the
        turn's trace (it was a root of its own there); an offload, outside any request, has none to send."""
        propagate.inject(headers)
        return headers

    async def store(self, session_id: str, replicas: int, links: list[bytes], frames: list[bytes | bytearray],
                    ttl_s: float | None) -> int:
        """PUT the frames (and links to blocks already there) on every replica; returns acks."""
        targets = self.replicas_for(session_id, replicas)
        body = encode_put(links, frames)
        params = {"ttl_s": f"{ttl_s:g}"} if ttl_s else None

        headers = self._traced({**self._headers, "content-type": CONTENT_TYPE})

        async def one(member: Member) -> bool:
            try:
                r = await self._http.put(f"{member.url}/v1/kv/sessions/{session_id}", content=body, params=params,
                                         headers=headers,
                                         timeout=self._timeout_s * 4)
            except httpx.HTTPError as exc:
                log.warning("cache node %s unreachable for a KV store: %s", member.id, type(exc).__name__)
                return False
            if r.status_code != 200:
                log.warning("cache node %s answered a KV store with %d", member.id, r.status_code)
            return r.status_code == 200

        return sum(await asyncio.gather(*(one(m) for m in targets)))

    async def fetch(self, session_id: str, replicas: int, hashes: Sequence[bytes], skip: int) -> Fetched | None:
        """The longest leading run of `hashes` a replica holds, with the frames past `skip` (blocks
        the shard has locally are not sent). Replicas are asked local zone first; one that answers
        with fewer blocks than another might have is followed by the next. None: nobody answered."""
        best: Fetched | None = None
        sent = self._traced({**self._headers, "content-type": CONTENT_TYPE})  # every replica's: the cluster token
        for member in self.replicas_for(session_id, replicas):
            if self._suspect_until.get(member.id, 0.0) > time.monotonic():
                continue
            started = time.perf_counter()
            try:
                status, headers, body = await post_raw(
                    member.url, f"/v1/kv/fetch?skip={skip}", b"".join(hashes), sent, self._timeout_s)
            except (OSError, TimeoutError, RawHTTPError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ssl.SSLError) as exc:
                log.warning("cache node %s unreachable for a KV fetch: %s (skipped for %.0f s)", member.id,
                            type(exc).__name__, SUSPECT_S)
                self._suspect_until[member.id] = time.monotonic() + SUSPECT_S
                continue
            if status != 200:
                log.warning("cache node %s answered a KV fetch with %d", member.id, status)
                continue
            try:
                run = int(headers.get("x-kv-run", "0"))
            except ValueError:
                run = 0
            got = Fetched(run, body, member.id, time.perf_counter() - started)
            if best is None or got.run > best.run:
                best = got
            if got.run >= len(hashes):
                break
        return best
