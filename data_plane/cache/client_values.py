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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data_plane.common.errors import InvalidRequest, SwitchboardError, from_openai_body
from data_plane.membership.hashring import HashRing
from data_plane.membership.placement import replicas_across_zones

if TYPE_CHECKING:
    from data_plane.membership.view import Member


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
    return InvalidRequest(f"This conversation has grown too large to store another turn ({err.message}): start a "
                          "new one (POST /v1/responses/compact can shorten its history to carry over), or delete "
                          "items from this one.", code="record_too_large")


@dataclass
class Placement:
    """The healthy cache members as a ring, and when this preference order took effect here."""

    key: tuple[tuple[str, str, str], ...] = ()
    ring: HashRing = field(default_factory=lambda: HashRing(()))
    by_id: dict[str, Member] = field(default_factory=dict)
    zone_of: dict[str, str] = field(default_factory=dict)
    since: float = field(default_factory=time.time)
    """Wall-clock time this preference order took effect here."""


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
