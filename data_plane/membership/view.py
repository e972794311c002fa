"""Who is out there: the data plane's view of membership (the protocol every router reads).

    view = StaticMembership([Member("shard-a", "shard", "http://127.0.0.1:8101")])
    view.members("shard")                       # routable shards, sorted by id

Every process that routes (gateway, cache client, shard KV tiers, control-plane signals) reads a
:class:`MembershipView`; the implementations are :class:`StaticMembership` (fixed lists, tests),
``HttpMembership`` (the embedded registry: data_plane/membership/embedded.py) and
``ConsulMembership`` (data_plane/membership/consul.py); data_plane/membership/factory.py picks one
from a URL. ``routable`` and ``routing_key`` are the helpers those implementations share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from data_plane.membership.placement import DEFAULT_ZONE

ROUTABLE_STATUS = "passing"


@dataclass(frozen=True)
class Member:
    """One registered process as the registry last reported it."""

    id: str
    """Unique, e.g. ``shard-127.0.0.1-8101``."""
    service: str
    """``shard`` | ``cache`` | ``gateway``."""
    url: str
    """Base URL, e.g. ``http://127.0.0.1:8101``."""
    meta: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Free-form string facts, e.g. ``{"model": "SmolLM2-135M-Instruct"}``."""
    status: str = "passing"
    """``passing`` | ``critical`` | ``draining``; only passing members are routable."""
    last_heartbeat: float = 0.0
    """Unix seconds of the member's last accepted heartbeat."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Member:
        """Build from a registry member dict; unknown keys are ignored."""
        meta = data.get("meta") or {}
        return cls(
            id=str(data["id"]),
            service=str(data["service"]),
            url=str(data["url"]),
            meta={str(k): str(v) for k, v in meta.items()},
            status=str(data.get("status", "passing")),
            last_heartbeat=float(data.get("last_heartbeat") or 0.0),
        )

    @property
    def routable(self) -> bool:
        return self.status == ROUTABLE_STATUS

    @property
    def zone(self) -> str:
        """The failure domain it announced (meta ``zone``), ``local`` if none: data_plane/membership/placement.py."""
        return self.meta.get("zone") or DEFAULT_ZONE


def routing_key(member: Member) -> tuple[Any, ...]:
    """What a change means to a router (heartbeat times excluded)."""
    return (member.id, member.service, member.url, tuple(sorted(member.meta.items())), member.status)


class MembershipView(Protocol):
    """What the data plane needs to know about membership. Called on every routing decision,
    so implementations answer from memory, never over the network."""

    def members(self, service: str) -> list[Member]:
        """Routable members of `service` (passing, not draining), as last known; sorted by id."""
        ...


def routable(members: Iterable[Member], service: str) -> list[Member]:
    """Routable members of `service`, sorted by id. Asked several times per request, so for a
    tuple (views replace theirs on change, never mutate it) the answer is kept until it changes."""
    if not isinstance(members, tuple):
        return sorted((m for m in members if m.service == service and m.routable), key=lambda m: m.id)
    key = (id(members), service)
    hit = _ROUTABLE_MEMO.get(key)
    if hit is not None and hit[0] is members:
        return list(hit[1])
    found = tuple(sorted((m for m in members if m.service == service and m.routable), key=lambda m: m.id))
    if len(_ROUTABLE_MEMO) > 64:
        _ROUTABLE_MEMO.clear()
    _ROUTABLE_MEMO[key] = (members, found)
    return list(found)


_ROUTABLE_MEMO: dict[tuple[int, str], tuple[tuple[Member, ...], tuple[Member, ...]]] = {}
"""(id of a members tuple, service) -> (that tuple, kept alive so the id stays unique; the answer)."""


class StaticMembership:
    """A fixed list, for tests and ``--shard-url`` style flags.

    StaticMembership([Member("shard-0", "shard", "http://127.0.0.1:8101")]).members("shard")
    """

    def __init__(self, members: Iterable[Member]) -> None:
        self._members = tuple(members)

    def members(self, service: str) -> list[Member]:
        return routable(self._members, service)

    def subscribe(self, callback: Callable[[], None]) -> None:
        """The list never changes, so `callback` is never called (a router reads it once)."""


__all__ = ["ROUTABLE_STATUS", "Member", "MembershipView", "StaticMembership", "routable", "routing_key"]
