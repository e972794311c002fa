"""The small values the gateway's session store (data_plane/cache/client.py) keeps and passes between
its methods: one replica write's result, the placement it computed, its bounded LRU of session ids.

    placement = Placement(key, HashRing(ids), by_id, zone_of)
    newest_last(recent, "sess-1", 2, cap=10_000)
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data_plane.membership.hashring import HashRing

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


@dataclass
class Placement:
    """The healthy cache members as a ring, and when this preference order took effect here."""

    key: tuple[tuple[str, str, str], ...] = ()
    ring: HashRing = field(default_factory=lambda: HashRing(()))
    by_id: dict[str, Member] = field(default_factory=dict)
    zone_of: dict[str, str] = field(default_factory=dict)
    since: float = field(default_factory=time.time)
    """Wall-clock time this preference order took effect here."""


def json_or_none(raw: bytes) -> Any:
    """The body as JSON, or None when it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        return None
