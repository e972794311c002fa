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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from data_plane.kv_wire import CONTENT_TYPE, encode_put
from data_plane.membership.hashring import DEFAULT_VNODES, HashRing
from data_plane.membership.placement import DEFAULT_ZONE, local_first, replicas_across_zones

if TYPE_CHECKING:
    from data_plane.membership.view import Member, MembershipView

log = logging.getLogger(__name__)

CACHE_SERVICE = "cache"


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

    async def store(self, session_id: str, replicas: int, links: list[bytes], frames: list[bytes],
                    ttl_s: float | None) -> int:
        """PUT the frames (and links to blocks already there) on every replica; returns acks."""
        targets = self.replicas_for(session_id, replicas)
        body = encode_put(links, frames)
        params = {"ttl_s": f"{ttl_s:g}"} if ttl_s else None

        async def one(member: Member) -> bool:
            try:
                r = await self._http.put(f"{member.url}/v1/kv/sessions/{session_id}", content=body, params=params,
                                         headers={**self._headers, "content-type": CONTENT_TYPE},
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
        for member in self.replicas_for(session_id, replicas):
            started = time.perf_counter()
            try:
                r = await self._http.post(f"{member.url}/v1/kv/fetch", content=b"".join(hashes),
                                          params={"skip": str(skip)},
                                          headers={**self._headers, "content-type": CONTENT_TYPE},
                                          timeout=self._timeout_s)
            except httpx.HTTPError as exc:
                log.warning("cache node %s unreachable for a KV fetch: %s", member.id, type(exc).__name__)
                continue
            if r.status_code != 200:
                log.warning("cache node %s answered a KV fetch with %d", member.id, r.status_code)
                continue
            try:
                run = int(r.headers.get("x-kv-run", "0"))
            except ValueError:
                run = 0
            got = Fetched(run, r.content, member.id, time.perf_counter() - started)
            if best is None or got.run > best.run:
                best = got
            if got.run >= len(hashes):
                break
        return best
