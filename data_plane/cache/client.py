"""The gateway's view of session transcripts: placed, replicated and read-repaired on cache nodes.

    store = SessionStore(membership, HopPool(), registry=registry, timeout_s=1.0)
    transcript = await store.load("sess-1", owner="key-hash", replicas=2)   # None: new session
    acks = await store.save("sess-1", "key-hash", messages, version=3, replicas=2)
    await store.drain()                                                     # pending read-repairs
    await store.aclose()

Placement: the healthy ``cache`` members form a :class:`~data_plane.membership.hashring.HashRing` (rebuilt
when membership changes); a session lives on ``replicas`` nodes chosen along its preference list,
one per zone first (data_plane/membership/placement.py: a paid session's two copies sit in different zones,
a free session in the gateway's own zone), and reads ask the local zone's copy first.

- When nodes join the placement (a zone that comes back, a restarted node), the sessions saved
  through this store lately (up to ``MAX_RECENT``) that now place a replica on them are copied
  there in the background, so a paid session that is not read again still regains its second
  copy. Older sessions are repaired on their next read (below).

- ``load`` asks those nodes in ring order; the first one that has the record wins, unless the
  placement changed since it was written (or an audit, or a save here missed a replica): then the
  replicas after it are read too and the newest version wins (a node that was away may hold an
  old copy). Read-repair then runs in the background (tracked, so :meth:`SessionStore.drain` can
  wait for it): replicas that lack the record or hold an older version get it written back with
  its version, timestamps and remaining TTL. A record owned by someone else is reported as
  :class:`~data_plane.common.errors.NotFound` (``session_not_found``), exactly like a missing one would
  be to that caller; a tombstone (a deleted record, see ``delete``) reads as missing. If no node
  answered at all, the store is unavailable, not empty.
- A record written while one of its replicas was away sits on the node that stood in for it: until the
  next placement change, reads that miss or may lag ask it too (its handoff), and once the newest copy is
  back on every current replica the stand-in's copy is removed (only the version seen there,
  ``HANDOFF_SETTLE_S`` after the change; ``switchboard_session_moved_copies_total``). Left, it was served
  when that replica went away again: the conversation went back to it.
- ``save`` writes the whole transcript to every replica at once and returns how many
  acknowledged. Nodes keep the highest version (last writer by version wins); when every replica
  already holds a newer version the write raises :class:`VersionConflict`. A turn (``only_newer``)
  is written to the first replica that answers before the others, and an equal version there is a
  VersionConflict too: two gateways' turns on one version meet on that node, and one loses.

Errors raised (all from :mod:`data_plane.common.errors`)::

    InvalidRequest     400 invalid_session_id       the id does not match SESSION_ID_PATTERN
    NotFound           404 session_not_found        owner mismatch on load
    VersionConflict    409 session_version_conflict every replica holds a newer version
    Overloaded         503 cache_unavailable        no healthy cache node / no replica answered

The wire contract both sides share (:class:`Transcript`, :data:`SESSION_ID_PATTERN`,
:class:`VersionConflict`) is data_plane/cache/model.py, so neither side imports the other.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from data_plane.cache.client_calls import NodeCalls
from data_plane.cache.client_circuits import CircuitHops, NodeCircuits
from data_plane.cache.client_metrics import SessionStoreMetrics
from data_plane.cache.client_values import (
    Departures,
    Placement,
    RecordLimits,
    WriteResult,
    handoffs,
    newest_last,
    put_body,
    refused_write,
)
from data_plane.cache.model import TOMBSTONE_VERSION, Transcript, VersionConflict, validate_session_id
from data_plane.common.crypto import TranscriptSealer
from data_plane.common.errors import NotFound, Overloaded
from data_plane.membership.hashring import DEFAULT_VNODES, HashRing
from data_plane.membership.placement import DEFAULT_ZONE, local_first, replicas_across_zones
from data_plane.routing.hop_client import HopPool

if TYPE_CHECKING:
    from data_plane.membership.view import Member, MembershipView

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

CACHE_SERVICE = "cache"
"""The membership service name cache nodes register under."""
MAX_SUSPECTS, MAX_RECENT = 10_000, 10_000
"""Sessions saved here lately that a returning node or zone gets back in the background (bounded LRU)."""
REPAIR_CONCURRENCY = 8
CLOCK_SLACK_S = 5.0
"""Records written this soon after a placement change (node and gateway clocks may differ) are
treated as possibly written under the old placement."""
AUDIT_SHARE = 0.05
"""Share of reads that check the replicas they did not need to ask, whatever the above says."""
HANDOFF_SETTLE_S = 10.0
"""How long after a placement change a copy of a record on a node that is no longer its replica stays, once the
record is back on its replicas: a gateway whose membership view lags may still read and write it there."""
SETTLED = ("ok", "stale")
"""Repair results after which a replica holds the record's newest version (or a newer one)."""


class SessionStore(NodeCalls):
    """Places, replicates and reads session transcripts on the healthy cache nodes."""

    def __init__(
        self,
        membership: MembershipView,
        http: HopPool,
        registry: CollectorRegistry | None = None,
        timeout_s: float = 1.0,
        *,
        vnodes: int = DEFAULT_VNODES,
        service: str = CACHE_SERVICE,
        sealer: TranscriptSealer | None = None,
        headers: Mapping[str, str] | None = None,
        zone: str = DEFAULT_ZONE,
        prefix: str = "/v1/sessions",
    ) -> None:
        """`registry`: where the metrics go (None: a private registry nobody scrapes). `sealer`:
        transcripts are encrypted before they leave and opened on arrival (data_plane/common/crypto.py);
        None stores plaintext (tests of the node itself). `prefix`: the nodes' route for these records
        (``/v1/response-cache`` holds the response cache, data_plane/gateway/response_cache.py)."""
        self._sealer = sealer
        self._zone = zone
        """This gateway's zone: replicas go one per zone (data_plane/membership/placement.py), reads ask ours first."""
        self._auth = dict(headers or {})
        """Sent on every call: the cluster token cache nodes require (data_plane/common/hop_auth.py)."""
        self.metrics = SessionStoreMetrics(registry if registry is not None else CollectorRegistry())
        self._http = CircuitHops(http, NodeCircuits(self.metrics.node_circuit))  # a node this gateway cannot reach
        self._membership, self._timeout_s = membership, timeout_s
        self._vnodes, self._service, self._prefix = vnodes, service, prefix
        self._placement = self._previous = Placement()
        self._departures = Departures()
        self._repairs: set[asyncio.Task[Any]] = set()
        self._removals: set[asyncio.Task[None]] = set()
        """Removals of copies left on nodes that held a record while its replica was away (HANDOFF_SETTLE_S)."""
        self._removing: set[tuple[str, frozenset[tuple[str, int]]]] = set()  # what those remove (record, copies)
        self._suspects: OrderedDict[str, None] = OrderedDict()
        """Sessions whose last save here missed a replica (bounded, oldest forgotten first)."""
        self._recent: OrderedDict[str, int] = OrderedDict()
        """Sessions saved here lately -> their replica count: what a node that joins is repaired with."""
        self._rejoined: set[str] = set()
        """Node ids added to the placement whose background repair has not run yet."""
        self._placement_repair: asyncio.Task[Any] | None = None
        self._limits = RecordLimits()

    # -- public API -------------------------------------------------------------------------

    async def load(self, session_id: str, owner: str, replicas: int, expected: bool = False) -> Transcript | None:
        """The transcript of `session_id` if `owner` holds it; None for a new session. `expected`: the id was
        handed out (a client continues it), so a miss while a node that held it is lately away is a 503."""
        validate_session_id(session_id)
        with self.metrics.op("load", "cache.get_context") as (outcome, span):
            targets = self.replicas_for(session_id, replicas)
            missing: list[Member] = []
            answered = False
            found: Transcript | None = None
            asked, kinds = 0, dict[str, str]()
            for asked, member in enumerate(targets, 1):
                kind, transcript = await self._fetch(member, session_id)
                kinds[member.id] = kind
                if kind == "hit":
                    found = transcript
                    break
                if kind in ("miss", "unreadable"):  # unreadable: repaired like a missing one if another has it
                    answered = True
                    missing.append(member)
            span.set_attribute("switchboard.session.replicas_missing", len(missing))
            extra = handoffs(self._previous, self._placement, session_id, replicas, self._zone, targets)
            moved: list[tuple[Member, int]] = []  # copies on `extra`: removed once the record is back on `targets`
            if found is None and extra:  # written while a node that joined since was away: on the one before it
                for member in extra:
                    kind, found = await self._fetch(member, session_id)
                    answered = answered or kind != "error"
                    if found is not None:
                        moved.append((member, found.version))
                        break
            if found is None:
                if not answered:
                    raise Overloaded("no cache replica answered", code="cache_unavailable", retry_after=1)
                if expected and self._departures.may_hold(session_id, replicas, self._placement, self._vnodes,
                                                          self._zone):
                    outcome.result = "away"
                    raise Overloaded("the cache node holding this record is away (restarting?); retry shortly",
                                     code="cache_unavailable", retry_after=2)
                outcome.result = "miss"
                return None
            if self._may_lag(found):  # a replica not asked may hold a newer version, or the record's tombstone
                rest = [m for m in targets[asked:] + extra if m != member]  # `member`: where `found` is from
                found, stale, copies = await self._newest(member, found, rest)
                missing += [m for m in stale if m not in extra]
                kinds.update({m.id: "hit" for m, _ in copies if m in targets})
                kinds.update({m.id: "miss" for m in stale if m in targets})  # unreadable too: repaired like one
                moved = [(m, t.version) for m, t in copies if m in extra]
            if any(kinds.get(m.id, "error") == "error" for m in targets):
                moved = []  # a replica's copy is unknown: the handoff's may be the newest one left
            if found.owner != owner and not found.deleted:
                outcome.result = "denied"  # and nothing repaired on another key's behalf
                raise NotFound(
                    f"session {session_id!r} not found", param="session_id", code="session_not_found"
                )
            if missing or moved:
                self._start_repair(found, missing, moved, replicas)  # a tombstone too: it spreads over old copies
            if found.deleted:
                outcome.result = "deleted"
                span.set_attribute("switchboard.session.tombstone", True)
                return None
            outcome.result = "hit"
            return found

    async def save(
        self,
        session_id: str,
        owner: str,
        messages: Sequence[Mapping[str, str]],
        version: int,
        replicas: int,
        ttl_s: float | None = None,
        only_newer: bool = False,
    ) -> int:
        """Write the whole transcript to every replica at once (`only_newer`: the first that answers
        first, see the module docstring); returns how many acknowledged."""
        validate_session_id(session_id)
        with self.metrics.op("save", "cache.append") as (outcome, span):
            targets = self.replicas_for(session_id, replicas)
            transcript = Transcript(session_id, owner, tuple(messages), version, updated_at=time.time())
            first: list[WriteResult] = []
            while only_newer and len(first) < len(targets) and (not first or first[-1].result == "error"):
                first.append(await self._put(targets[len(first)], transcript, ttl_s, keep_updated_at=False,
                                             only_newer=True))
            rest = [] if first and first[-1].result != "ok" else targets[len(first):]
            results = first + await asyncio.gather(
                *(self._put(m, transcript, ttl_s, keep_updated_at=False) for m in rest)
            )
            acks = sum(1 for r in results if r.result == "ok")
            span.set_attribute("switchboard.session.acks", acks)
            if acks:
                newest_last(self._recent, session_id, replicas, MAX_RECENT)
            if 0 < acks < len(targets):
                newest_last(self._suspects, session_id, None, MAX_SUSPECTS)  # a replica missed this write: check it on the next read
            elif acks == len(targets):
                self._suspects.pop(session_id, None)
            if acks == 0:
                stale = [r.stored_version for r in results if r.result == "stale"]
                if stale:
                    outcome.result = "stale"
                    raise VersionConflict(
                        f"session {session_id!r} already has a newer version",
                        param="version",
                        stored_version=max(v or 0 for v in stale),
                    )
                rejected = [r for r in results if r.result == "rejected"]
                if len(rejected) == len(results):
                    raise refused_write(rejected[0])
                raise Overloaded(
                    "no cache replica acknowledged the write", code="cache_unavailable", retry_after=1
                )
            outcome.result = "ok" if acks == len(targets) else "partial"
            return acks

    async def delete(self, session_id: str, owner: str, replicas: int) -> int:
        """Remove `session_id` (and its KV blocks) from every cache node and leave its tombstone
        (:data:`~data_plane.cache.model.TOMBSTONE_VERSION`) on the replicas: a node that missed the delete
        holds an older version, which cannot be written over it nor win a read that compares replicas
        (after a placement change or a missed write), and gets it by read-repair or the background
        repair of joining nodes. NotFound unless `owner` holds it. Returns the nodes that held it."""
        found = await self.load(session_id, owner, replicas, expected=True)  # its node away: 503, not a 404 that
        if found is None:  # the record then outlives when it comes back
            raise NotFound(f"session {session_id!r} not found", param="session_id", code="session_not_found")
        await self._drain(self._repairs)  # a read-repair that load started must not write it back afterwards
        with self.metrics.op("delete", "cache.delete") as (outcome, span):
            members = self._membership.members(self._service)
            held = sum(await asyncio.gather(*(self._delete_one(m, session_id) for m in members)))
            tombstone = Transcript(session_id, owner, (), TOMBSTONE_VERSION, updated_at=time.time())
            ttl = found.ttl_left(time.time())  # as long as a stale copy could live, no longer
            ttl = None if ttl is None else max(ttl, 1.0)
            marked = await asyncio.gather(*(self._put(m, tombstone, ttl, keep_updated_at=False)
                                            for m in self.replicas_for(session_id, replicas)))
            if any(r.result != "ok" for r in marked):  # a replica missed it: the next read compares them all
                newest_last(self._suspects, session_id, None, MAX_SUSPECTS)
            newest_last(self._recent, session_id, self._recent.get(session_id, replicas), MAX_RECENT)  # joiners: the tombstone
            span.set_attribute("switchboard.session.deleted_copies", held)
            span.set_attribute("switchboard.session.tombstones", sum(r.result == "ok" for r in marked))
            outcome.result = "ok"
            return held

    def replicas_for(self, session_id: str, replicas: int) -> list[Member]:
        """The cache members that should hold `session_id` now, in preference order."""
        members = self._membership.members(self._service)
        if not members:
            raise Overloaded("no healthy cache nodes", code="cache_unavailable", retry_after=1)
        placement = self._refresh_placement(members)
        ids = replicas_across_zones(placement.ring.walk(session_id), max(1, replicas), placement.zone_of,
                                    local=self._zone)
        return [placement.by_id[i] for i in local_first(ids, placement.zone_of, self._zone)]

    def on_membership_change(self) -> None:
        """Subscribed to the membership view: a node that joins gets its background repair at once,
        not at the next session request."""
        members = self._membership.members(self._service)
        if members:
            self._refresh_placement(members)

    def _refresh_placement(self, members: list[Member]) -> Placement:
        key = tuple((m.id, m.url, m.zone) for m in members)
        if key != self._placement.key:
            added = {m.id for m in members} - set(self._placement.by_id)
            self._previous = self._placement
            self._departures.changed(self._placement, {m.id for m in members})
            self._http.circuits.membership_changed({m.url for m in members if m.id in added}, {m.url for m in members})
            if added and self._placement.key:  # a node (or a zone) joined or came back
                self._schedule_placement_repair(added)
            self._placement = Placement(
                key, HashRing((m.id for m in members), self._vnodes), {m.id: m for m in members},
                zone_of={m.id: m.zone for m in members},
            )
        return self._placement

    async def drain(self) -> None:
        """Wait for every read-repair, background placement repair and removal of moved copies started so far."""
        await self._drain(self._repairs, self._removals)

    @staticmethod
    async def _drain(*tasks: set[asyncio.Task[Any]]) -> None:
        while any(tasks):
            await asyncio.gather(*(t for group in tasks for t in list(group)), return_exceptions=True)

    def _schedule_placement_repair(self, added: set[str]) -> None:
        """Give nodes that joined the sessions saved here lately that now place a replica on them: read
        repair alone would leave a paid session that is not read again with one copy after a zone returns."""
        self._rejoined |= added
        if self._placement_repair is None or self._placement_repair.done():
            task = asyncio.get_running_loop().create_task(self._repair_placement(), name="session-placement-repair")
            self._placement_repair = task
            self._repairs.add(task)
            task.add_done_callback(self._repairs.discard)

    async def _repair_placement(self) -> None:
        await asyncio.sleep(0)  # let the request that noticed the change go on first
        while self._rejoined:
            added, self._rejoined = self._rejoined, set()
            sessions = list(self._recent.items())
            gate = asyncio.Semaphore(REPAIR_CONCURRENCY)
            written = moving = 0

            async def one(session_id: str, replicas: int) -> None:
                nonlocal written, moving
                try:
                    targets = self.replicas_for(session_id, replicas)
                except Overloaded:
                    return
                if not any(m.id in added for m in targets):  # noqa: B023 -- `one` is awaited in this pass
                    return
                extra = handoffs(self._previous, self._placement, session_id, replicas, self._zone, targets)
                async with gate:  # noqa: B023
                    repaired, removing = await self._settle(session_id, replicas, targets, extra)
                    written, moving = written + repaired, moving + removing

            with tracer.start_as_current_span("cache.placement_repair") as span:
                await asyncio.gather(*(one(sid, n) for sid, n in sessions))
                span.set_attribute("switchboard.session.repair_candidates", len(sessions))
                span.set_attribute("switchboard.session.repaired", written)
            log.info("background repair after %s joined: %d session(s) checked, %d replica(s) written, %d copy(ies) "
                     "to remove from nodes that stood in meanwhile", ", ".join(sorted(added)), len(sessions), written,
                     moving)

    async def aclose(self) -> None:
        """Cancel pending read-repairs (they are best-effort)."""
        tasks = [*self._repairs, *self._removals]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- internals --------------------------------------------------------------------------

    def check_fits(self, session_id: str, owner: str, messages: Callable[[], Sequence[Mapping[str, str]]], replicas: int,
                   rough: int) -> None:
        """400 ``record_too_large`` now if no replica of `session_id` would store `messages()` (client_values.py)."""
        self._limits.check(self.replicas_for(session_id, replicas), rough, lambda: len(put_body(
            self._sealer, Transcript(session_id, owner, tuple(messages()), 1, updated_at=time.time()), None)))

    def _may_lag(self, found: Transcript) -> bool:
        """Whether replicas not asked during a read may lack `found`. Every save writes all current
        replicas, so only: the preference order changed since the record was written (a new node
        sits on the list), a save here missed a replica, or a small random audit (anti-entropy for
        what this gateway cannot know, e.g. another gateway's partial write). Asking every time
        doubled the cache reads of every resumed session."""
        return (found.updated_at < self._placement.since + CLOCK_SLACK_S
                or found.session_id in self._suspects or random.random() < AUDIT_SHARE)

    async def _newest(self, first: Member, found: Transcript, rest: list[Member],
                      ) -> tuple[Transcript, list[Member], list[tuple[Member, Transcript]]]:
        """The newest of `found` (from `first`) and the copies `rest` hold, the members that lack it
        or hold an older version (to repair), and every copy seen."""
        fetched = await asyncio.gather(*(self._fetch(m, found.session_id) for m in rest))
        copies = [(first, found), *((m, t) for m, (_, t) in zip(rest, fetched, strict=True) if t is not None)]
        newest = max((t for _, t in copies), key=lambda t: t.version)
        behind = [m for m, t in copies if t.version < newest.version]
        lacking = [m for m, (kind, _) in zip(rest, fetched, strict=True) if kind in ("miss", "unreadable")]
        return newest, behind + lacking, copies

    async def _settle(self, session_id: str, replicas: int, targets: list[Member], extra: list[Member],
                      ) -> tuple[int, int]:
        """A joiner's background repair of one record: the newest of the copies its replicas (`targets`) and the
        nodes that held it before (`extra`) hold is written to the replicas without it, then the copies on
        `extra` are removed (`_repair`). Returns how many replicas were written and copies are to be removed."""
        asked = targets + extra
        fetched = await asyncio.gather(*(self._fetch(m, session_id) for m in asked))
        copies = [(m, t) for m, (_, t) in zip(asked, fetched, strict=True) if t is not None]
        if not copies:
            return 0, 0
        newest = max((t for _, t in copies), key=lambda t: t.version)
        behind = [m for m, (kind, t) in zip(targets, fetched[:len(targets)], strict=True)
                  if kind in ("miss", "unreadable") or (t is not None and t.version < newest.version)]
        known = all(kind != "error" for kind, _ in fetched[:len(targets)])
        moved = [(m, t.version) for m, t in copies if m in extra] if known else []
        return await self._repair(newest, behind, moved, replicas)

    def _start_repair(self, transcript: Transcript, behind: list[Member], moved: list[tuple[Member, int]],
                      replicas: int) -> None:
        task = asyncio.create_task(self._repair(transcript, behind, moved, replicas), name="session-read-repair")
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _repair(self, transcript: Transcript, behind: list[Member], moved: list[tuple[Member, int]],
                      replicas: int) -> tuple[int, int]:
        """Write `transcript` to the replicas that lack it or hold an older version (nodes keep the
        highest version, so a newer save that lands meanwhile is never overwritten); once every replica holds
        it, remove the copies `moved` names (node, version seen) from nodes that held it while a replica was
        away. Left there, such a copy was read again when that replica next went away: the conversation went
        back to it, and a turn written on it then lost to the replica's newer version when it came back.
        Returns how many replicas were written, and how many copies are to be removed."""
        with tracer.start_as_current_span("cache.read_repair") as span:
            results = await asyncio.gather(*(self._repair_one(m, transcript) for m in behind))
            span.set_attribute("switchboard.session.repair_candidates", len(behind))
            span.set_attribute("switchboard.session.moved_copies", len(moved))
        key = (transcript.session_id, frozenset((m.id, v) for m, v in moved))
        if moved and all(r in SETTLED for r in results) and key not in self._removing:  # else the moved copy may
            self._removing.add(key)  # be the newest one left (or its removal is already due: reads meanwhile)
            task = asyncio.create_task(self._remove_moved(key[0], moved, replicas), name="session-moved-copy-removal")
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)
            task.add_done_callback(lambda _: self._removing.discard(key))
            return sum(r == "ok" for r in results), len(moved)
        return sum(r == "ok" for r in results), 0

    async def _remove_moved(self, session_id: str, moved: list[tuple[Member, int]], replicas: int) -> None:
        """Remove the copies `moved` names, each only while its node holds the version seen (a write that landed
        there since stays), after HANDOFF_SETTLE_S and only from nodes that are still not its replicas."""
        await asyncio.sleep(max(0.0, self._placement.since + HANDOFF_SETTLE_S - time.time()))
        try:
            now = {m.id for m in self.replicas_for(session_id, replicas)}
        except Overloaded:
            return
        moved = [(m, v) for m, v in moved if m.id not in now]  # a replica again (it left once more): it serves
        results = await asyncio.gather(*(self._remove_copy(m, session_id, v) for m, v in moved))
        for (member, version), result in zip(moved, results, strict=True):
            self.metrics.moved_copies.labels(result).inc()
            if result in ("kept", "error"):
                log.info("copy of a record moved back to its replicas left on %s (%s, version %s seen)",
                         member.id, result, "tombstone" if version == TOMBSTONE_VERSION else version)

    async def _repair_one(self, member: Member, transcript: Transcript) -> str:
        """Write `transcript` to `member` (nodes keep the highest version): ok | stale (it holds a newer one) |
        error | expired (its TTL is over)."""
        ttl = transcript.ttl_left(time.time())
        if ttl is not None and ttl <= 0:
            return "expired"
        r = await self._put(member, transcript, ttl, keep_updated_at=True)
        result = r.result if r.result in ("ok", "stale") else "error"
        self.metrics.ops.labels("repair", result).inc()
        if result == "ok":
            self.metrics.repairs.inc()
        else:
            log.info("read-repair onto %s: %s", member.id, result)
        return result

