"""The small values the gateway's session store (data_plane/cache/client.py) keeps and passes between
its methods: one replica write's result, the placement it computed, the nodes that left it lately, its
bounded LRU of session ids.

    placement = Placement(key, HashRing(ids), by_id, zone_of)
    newest_last(recent, "sess-1", 2, cap=10_000)
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data_plane.cache.model import LIMIT_HEADER, LIMIT_META
from data_plane.common.errors import InvalidRequest, SwitchboardError, from_openai_body
from data_plane.membership.hashring import HashRing
from data_plane.membership.placement import replicas_across_zones

if TYPE_CHECKING:
    from data_plane.cache.model import Transcript
    from data_plane.common.crypto import TranscriptSealer
    from data_plane.membership.view import Member
    from data_plane.routing.hop_client import HopResponse


def newest_last(entries: OrderedDict[str, Any], key: str, value: Any, cap: int) -> None:
    """`key` -> `value` as the newest of `entries`, the oldest dropped past `cap` (every path that adds)."""
    entries[key] = value
    entries.move_to_end(key)
    if len(entries) > cap:
        entries.popitem(last=False)


@dataclass(frozen=True)
class WriteResult:
    """One replica's answer to a PUT."""

    result: str  # ok | stale | rejected | error
    status: int | None = None
    body: Any = None
    stored_version: int | None = None


def refused_write(rejected: WriteResult) -> SwitchboardError:
    """The error of a write every replica refused, for the client. A node's 413 (the record past its
    --max-body-bytes or its capacity) is about the stored record, which grows with every turn, not the
    client's request: a 400 that says so. It passed through as the node's 413 "request body exceeds 4194304
    bytes", which a client reads as its own (a 1 KB turn or item), on every later turn of the conversation."""
    err = from_openai_body(rejected.status or 400, rejected.body)
    if rejected.status != 413:
        return err
    return too_large(err.message)


def too_large(why: str) -> InvalidRequest:
    return InvalidRequest(f"This conversation has grown too large to store another turn ({why}): start a "
                          "new one (POST /v1/responses/compact can shorten its history to carry over), or delete "
                          "items from this one.", code="record_too_large")


def put_body(sealer: TranscriptSealer | None, t: Transcript, ttl_s: float | None, *, keep_updated_at: bool = False,
             only_newer: bool = False) -> bytes:
    """A record write's PUT body (`t` sealed, unless `sealer` is None): what a node's --max-body-bytes bounds."""
    messages = sealer.seal(t.session_id, t.owner, t.messages) if sealer is not None else [dict(m) for m in t.messages]
    body: dict[str, Any] = {"owner": t.owner, "messages": messages, "version": t.version, "ttl_s": ttl_s}
    if keep_updated_at:
        body["updated_at"] = t.updated_at
    if only_newer:
        body["only_newer"] = True
    return json.dumps(body, ensure_ascii=False).encode()


class RecordLimits:
    """The largest record write each cache node is known to take: its advertised `LIMIT_META`, else what its
    last 413 said (a node listed by URL advertises nothing; forgotten after `LEARNED_S`, as a restart may raise
    it), so a turn whose record cannot be stored is refused before it generates (`check`), not after."""

    LEARNED_S = 300.0

    def __init__(self) -> None:
        self._refused: dict[str, tuple[int, float]] = {}
        """Node id -> (the largest PUT body it takes, when it said so): one entry a node, bounded by the cluster."""

    def refused(self, member_id: str, size: int, resp: HopResponse) -> None:
        """A node's 413 to a `size`-byte write (`resp`: its LIMIT_HEADER says what it takes at most)."""
        said = resp.header(LIMIT_HEADER.lower().encode())
        self._refused[member_id] = (int(said) if said is not None and said.isdigit() else size - 1, time.monotonic())

    def limit(self, member: Member) -> int | None:
        advertised = member.meta.get(LIMIT_META, "")
        if advertised.isdigit():
            return int(advertised)
        limit, when = self._refused.get(member.id, (0, 0.0))
        return limit if when and time.monotonic() - when < self.LEARNED_S else None

    def check(self, targets: list[Member], rough: int, size: Callable[[], int]) -> None:
        """record_too_large when every one of `targets` is known to refuse a write of `size()` bytes (computed
        only near a limit: `rough`, the record's UTF-8 length, is at least half of any body it makes)."""
        limits = [self.limit(m) for m in targets]
        if not limits or None in limits:
            return  # a node whose limit is unknown may take it: the write says
        most = max(limit for limit in limits if limit is not None)
        if 2 * rough + 4096 <= most:
            return
        needed = size()
        if needed > most:
            raise too_large(f"its record would be {needed} bytes, over the {most} a cache node stores")


@dataclass
class Placement:
    """The healthy cache members as a ring, and when this preference order took effect here."""

    key: tuple[tuple[str, str, str], ...] = ()
    ring: HashRing = field(default_factory=lambda: HashRing(()))
    by_id: dict[str, Member] = field(default_factory=dict)
    zone_of: dict[str, str] = field(default_factory=dict)
    since: float = field(default_factory=time.time)
    """Wall-clock time this preference order took effect here."""


def handoffs(previous: Placement, now: Placement, record_id: str, replicas: int, zone: str,
             targets: list[Member]) -> list[Member]:
    """The members that were `record_id`'s replicas under the `previous` placement and are not now: a node that
    joined (came back) took their place, and what was written while it was away sits on them. (Seen: a free
    conversation's turn written while its node was stopped went to the next node; when it came back, its old
    copy was read and the turn was gone, with nothing logged.)"""
    if not previous.key:
        return []
    ids = replicas_across_zones(previous.ring.walk(record_id), max(1, replicas), previous.zone_of, local=zone)
    current = {m.id for m in targets}
    return [now.by_id[i] for i in ids if i in now.by_id and i not in current]


DEPARTED_GRACE_S = 30.0
"""How long after a cache node left the placement a miss on a record it may have held is the store being
unavailable (503 ``cache_unavailable``, Retry-After), not the record's absence (404): a restarted node is
back with its snapshot within seconds. (Seen: a free session's only node killed -9 answered 404, "start a
new conversation", for ~2 s, then the session again; a node gone for good costs its records this long
later.)"""


@dataclass
class Departures:
    """Cache nodes that left the placement lately: id -> (monotonic time it left, its zone)."""

    left: dict[str, tuple[float, str]] = field(default_factory=dict)
    _ring: tuple[tuple[object, ...], HashRing] | None = field(default=None, repr=False, compare=False)
    """The ring "as it was" for the last (placement, departed nodes) asked about: a ring of 128 vnodes a
    node costs 1-3 ms to build, and every continued session the departed node held misses in the grace."""

    def changed(self, before: Placement, now_ids: set[str]) -> None:
        """The placement goes from `before` to the nodes `now_ids`: who left is remembered, who came back is not."""
        at = time.monotonic()
        for node in set(before.by_id) - now_ids:
            self.left[node] = (at, before.zone_of.get(node, ""))
        for node in now_ids & set(self.left):
            del self.left[node]

    def may_hold(self, record_id: str, replicas: int, placement: Placement, vnodes: int, zone: str) -> bool:
        """Whether a node that left within DEPARTED_GRACE_S was one of `record_id`'s replicas then."""
        oldest = time.monotonic() - DEPARTED_GRACE_S
        self.left = {node: v for node, v in self.left.items() if v[0] >= oldest}
        if not self.left:
            self._ring = None
            return False
        zone_of = {**placement.zone_of, **{node: z for node, (_, z) in self.left.items()}}
        key = (placement.key, vnodes, *sorted(self.left))
        if self._ring is None or self._ring[0] != key:  # as it was: built once per change, on a miss in the grace
            self._ring = (key, HashRing([*placement.by_id, *self.left], vnodes))
        ring = self._ring[1]
        return any(node in self.left for node in replicas_across_zones(ring.walk(record_id), max(1, replicas),
                                                                       zone_of, local=zone))


def json_or_none(raw: bytes) -> Any:
    """The body as JSON, or None when it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        return None
