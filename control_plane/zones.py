"""Zone outage as a decision: the control plane watches which zones still have healthy shards.

    watch = ZoneWatch(members, ZoneMetrics(registry))   # members: the Registry or ConsulMembers
    await watch.start()                                  # a tick every interval_s
    watch.zones()        # [{"zone": "a", "state": "up", "members": {"shard": 2, "cache": 1, ...}}, ...]
    watch.events()       # [{"at": ..., "zone": "a", "state": "down", "reason": "..."}], newest last
    await watch.aclose()

Each tick counts the passing members of every service per zone (membership meta ``zone``; see
data_plane/membership/placement.py). A zone is *up* while it has a passing shard; it goes *down* when a
zone that had shards has none passing and lost at least one by accident (it vanished or went
critical without draining first), and *up* again when one returns. A zone whose shards were all
drained on purpose (a scale-in, maintenance) is *drained*: a log line, no event, alert or
replacement. On *down*, the ``on_down`` callbacks (the autoscaler's ``replace_lost``) run only
while another zone is up: replacements need a surviving zone. Each change is an event
with its reason (kept for the admin API and the console's banner), a log line, and the metrics
``switchboard_zone_up{zone}`` (1/0; the alert ``SwitchboardZoneDown`` reads it) and
``switchboard_zone_members{service,zone}``. A zone seen once is remembered (at 0), so losing
all of it shows instead of vanishing; zone names come from the operator's ``--zone`` flags, so
the label stays bounded. Gateways route around a dead zone by themselves (membership drops its
members within their TTL): this is the operator's view of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from fastapi import APIRouter
from prometheus_client import CollectorRegistry, Counter, Gauge

from data_plane.common.tasks import every, stop_tasks
from data_plane.membership.placement import DEFAULT_ZONE

log = logging.getLogger(__name__)

SERVICES = ("shard", "cache", "gateway")
MAX_EVENTS = 200
PICK_PENDING_S = 120.0
"""How long a zone picked for a new shard counts that shard before it registers (a slow model load)."""


class MemberSnapshot(Protocol):
    """The membership read (the embedded Registry or ConsulMembers): called once per tick."""

    def snapshot(self, service: str | None = None) -> tuple[int, list[dict[str, Any]]]: ...


class ZoneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("switchboard_zone_up", "1 while the zone has a passing shard, 0 once it lost all of them.",
                        ["zone"], registry=registry)
        self.members = Gauge("switchboard_zone_members", "Passing members by service and zone.",
                             ["service", "zone"], registry=registry)
        self.transitions = Counter("switchboard_zone_transitions", "Zone state changes by zone and new state.",
                                   ["zone", "state"], registry=registry)


def count_by_zone(members: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """``{zone: {service: passing members}}`` from member dicts (``zone`` or ``meta.zone``)."""
    out: dict[str, dict[str, int]] = {}
    for m in members:
        meta = m.get("meta") or {}
        zone = str(m.get("zone") or meta.get("zone") or DEFAULT_ZONE)
        per = out.setdefault(zone, {s: 0 for s in SERVICES})
        if m.get("status", "passing") == "passing":
            service = str(m.get("service"))
            per[service] = per.get(service, 0) + 1
    return out


class ZoneWatch:
    """Owns one background task (``zone-watch``); see the module docstring."""

    def __init__(self, members: MemberSnapshot, metrics: ZoneMetrics | None = None, *, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time, expected: tuple[str, ...] = ()) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._members = members
        self._metrics = metrics
        self._interval_s = interval_s
        self._clock = clock
        self._counts: dict[str, dict[str, int]] = {}
        self._state: dict[str, str] = {}
        self._since: dict[str, float] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._task: asyncio.Task[None] | None = None
        self._on_down: list[Callable[[str, int], Awaitable[Any]]] = []
        self._shards: dict[str, tuple[str, str]] = {}
        """shard id -> (zone, status) at the last tick."""
        self._lost: dict[str, int] = {}
        """zone -> shards lost by accident since it was last up."""
        self._reactions: set[asyncio.Task[Any]] = set()
        self._expected = expected
        """Zones new shards may go into before any of their members is seen (--shard-zones)."""
        self._picks: dict[str, list[tuple[float, int]]] = {}
        """zone -> (when, its passing shards then) of each zone_for_new_shard answer lately."""

    async def start(self) -> None:
        self.tick()
        self._task = asyncio.create_task(every(self._interval_s, self.tick, "zone watch", log), name="zone-watch")

    def on_down(self, callback: Callable[[str, int], Awaitable[Any]]) -> None:
        """Call ``await callback(zone, shards_lost)`` when a zone goes down (e.g. the autoscaler's
        ``replace_lost``); run as a task, its failure logged."""
        self._on_down.append(callback)

    def zone_for_new_shard(self) -> str | None:
        """Where a new shard should go: the live named zone with the fewest shards, counting the ones
        picked here lately that have not registered yet (ties by name); None while no named zone is
        live (the default zone needs no ``--zone``). Live: up, or never had a shard (or drained) but
        has a passing cache node or gateway, or is one of ``expected`` (``--shard-zones``): `up --zones a,b
        --autoscale` starts with zones of caches and gateways only (or none seen yet), and its shards must go
        into them. A zone that is down is not chosen."""
        now = self._clock()
        fill: list[tuple[int, str]] = []
        counts = {**{z: {} for z in self._expected}, **self._counts}
        for zone, per in counts.items():
            state = self._state.get(zone, "no_shards")
            alive = state == "up" or (state in ("no_shards", "drained") and (
                zone in self._expected or per.get("cache", 0) + per.get("gateway", 0) > 0))
            if zone == DEFAULT_ZONE or not alive:
                continue
            shards = per.get("shard", 0)
            self._picks[zone] = [(at, base) for at, base in self._picks.get(zone, []) if now - at < PICK_PENDING_S]
            picks = [base for _, base in self._picks[zone]]
            pending = max(0, len(picks) - max(0, shards - min(picks))) if picks else 0
            fill.append((shards + pending, zone))
        if not fill:
            return None
        zone = min(fill)[1]
        self._picks.setdefault(zone, []).append((now, counts[zone].get("shard", 0)))
        return zone

    async def aclose(self) -> None:
        await stop_tasks(self._task, *self._reactions)
        self._task = None

    def _follow_shards(self, listed: list[dict[str, Any]]) -> None:
        """Per zone, the shards that left routing by accident since the zone was last up: gone or
        critical without draining first. A shard drained on purpose (a scale-in, maintenance) that
        then deregisters is not a loss."""
        now: dict[str, tuple[str, str]] = {}
        for m in listed:
            if m.get("service") == "shard":
                meta = m.get("meta") or {}
                now[str(m.get("id"))] = (str(m.get("zone") or meta.get("zone") or DEFAULT_ZONE),
                                         str(m.get("status", "passing")))
        for shard_id, (zone, status) in self._shards.items():
            later = now.get(shard_id)
            if status == "passing" and (later is None or later[1] == "critical"):
                self._lost[zone] = self._lost.get(zone, 0) + 1
        self._shards = now

    def tick(self) -> None:
        """Read membership once and record what changed."""
        _, listed = self._members.snapshot()
        self._follow_shards(listed)
        now_counts = count_by_zone(listed)
        for zone in self._counts:  # remembered zones stay, at 0
            now_counts.setdefault(zone, {s: 0 for s in SERVICES})
        now = self._clock()
        for zone, per in sorted(now_counts.items()):
            before = self._state.get(zone)
            if per.get("shard", 0) > 0:
                state = "up"
                self._lost[zone] = 0
            elif before == "down" or (before in ("up", "drained") and self._lost.get(zone, 0)):
                state = "down"  # it had shards and lost them: an outage
            elif before in ("up", "drained"):
                state = "drained"  # every shard was drained on purpose: no outage, nothing to replace
            else:
                state = "no_shards"  # caches or gateways only, never a shard: nothing to decide
            if state != before:
                self._transition(zone, before, state, per, now)
            if self._metrics is not None:
                if state in ("up", "down"):
                    self._metrics.up.labels(zone).set(1 if state == "up" else 0)
                for service, n in per.items():
                    self._metrics.members.labels(service, zone).set(n)
        self._counts = now_counts

    def _transition(self, zone: str, before: str | None, state: str, per: Mapping[str, int], now: float) -> None:
        self._state[zone] = state
        self._since[zone] = now
        if before in (None, "no_shards") or "drained" in (before, state):
            if state == "drained":
                log.info("zone %s has no passing shard: all were drained on purpose", zone)
            return  # first sight, a zone's first shard, or a deliberate drain: not an outage or a recovery
        if state == "down":
            lost = self._lost.get(zone, 0)
            reason = (f"zone {zone} has no passing shard (lost {lost}; caches {per.get('cache', 0)}, "
                      f"gateways {per.get('gateway', 0)}); gateways route to the other zones")
            log.warning("zone %s is DOWN: %s", zone, reason)
            survivors = [z for z, s in self._state.items() if s == "up" and z != zone]
            if survivors:  # replacements need somewhere to go; a whole-fleet outage is the autoscaler's own case
                for callback in self._on_down:
                    self._react(callback, zone, lost)
        else:
            reason = f"zone {zone} has {per.get('shard', 0)} passing shard(s) again"
            log.info("zone %s is up: %s", zone, reason)
        self._events.append({"at": now, "zone": zone, "state": state, "previous": before, "reason": reason})
        if self._metrics is not None:
            self._metrics.transitions.labels(zone, state).inc()

    def _react(self, callback: Callable[[str, int], Awaitable[Any]], zone: str, lost: int) -> None:
        async def run() -> None:
            try:
                await callback(zone, lost)
            except Exception:  # a failed reaction must not end the watch
                log.exception("reaction to zone %s going down failed", zone)

        try:
            task = asyncio.get_running_loop().create_task(run(), name=f"zone-down:{zone}")
        except RuntimeError:  # no loop (a synchronous test of the rule): nothing to run it on
            return
        self._reactions.add(task)
        task.add_done_callback(self._reactions.discard)

    def zones(self) -> list[dict[str, Any]]:
        return [{"zone": z, "state": self._state.get(z, "no_shards"), "since": self._since.get(z),
                 "members": dict(self._counts.get(z, {}))} for z in sorted(self._counts)]

    def events(self) -> list[dict[str, Any]]:
        return list(self._events)

    def down(self) -> list[str]:
        return [z for z, s in sorted(self._state.items()) if s == "down"]


def build_zones_router(watch: ZoneWatch, dependencies: list[Any]) -> APIRouter:
    """``GET /admin/v1/zones``: every zone's state and members, and recent zone events."""
    router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=dependencies)

    @router.get("/zones", summary="Zones: state (up | down | no_shards), passing members, recent events")
    async def zones() -> dict[str, Any]:
        return {"zones": watch.zones(), "down": watch.down(), "events": watch.events()}

    return router
