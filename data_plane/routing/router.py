"""Shard choice and shard health: affinity with bounded loads, power of two choices, ejection.

    router = Router(membership, RouterMetrics(registry))
    shard = router.pick(session_id="s-123", exclude=set())     # raises NoHealthyBackend
    with router.lease(shard):                                  # counts outstanding requests
        ...                                                    # call the shard
    router.report_success(shard)   /   router.report_failure(shard, "connect")

Policies (by name, :data:`POLICIES`; data_plane/routing/policies.py): a request with a session goes to its shard on a
consistent-hash ring with bounded loads (no shard above ``ceil((1+eps) * mean)``
outstanding), so its prefix stays warm where possible; one without a session takes the
less loaded of two random shards (least outstanding requests). ``kv_aware``
(data_plane/routing/kv_routing.py) weighs the shard holding the session's KV against the ring's choice:
expected cached tokens against load, with session affinity as the case where they agree.

Health is passive, Envoy-style outlier detection: ``eject_after`` consecutive failures
eject a shard for ``eject_s`` (doubling on repeat, capped); when that expires the shard is
*half-open*: it gets a single probe request; success restores it, failure ejects it again.
Every retry and ejection is a metric, a span event on the current span and a log line.
"""

from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from data_plane.common.errors import NoHealthyBackend
from data_plane.membership.placement import spills
from data_plane.membership.view import Member, MembershipView
from data_plane.routing.fleet import Scope, ShardFleet
from data_plane.routing.kv_routing import KVAwarePolicy, KVReports
from data_plane.routing.policies import AffinityPolicy, LeastLoadedPolicy, Policy

log = logging.getLogger(__name__)

SHARD_SERVICE = "shard"


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.retries = Counter("switchboard_router_retries", "Requests retried on another shard.", ["reason"],
                               registry=registry)
        self.resumes = Counter("switchboard_router_resumes", "Streams resumed on another shard mid-way.",
                               ["reason"], registry=registry)
        self.ejections = Counter("switchboard_router_ejections", "Shards ejected from routing after failures.",
                                 registry=registry)
        self.failures = Counter("switchboard_router_upstream_failures", "Failed shard calls by reason.",
                                ["reason"], registry=registry)
        self.decisions = Counter("switchboard_router_decisions", "Routing decisions by policy.", ["policy"],
                                 registry=registry)
        self.shards = Gauge("switchboard_router_shards", "Shards known to this router by state.", ["state"],
                            registry=registry)
        self.outstanding = Gauge("switchboard_router_outstanding_requests",
                                 "Requests in flight from this router to shards.", registry=registry)
        self.kv_decisions = Counter("switchboard_router_kv_decisions",
                                    "kv_aware routing of session turns by outcome (holder: where its KV is; ring: "
                                    "no known KV; holder_overloaded / holder_gone: the holder was too loaded / is "
                                    "out of routing, so the ring's choice; previous_holder: the shard that held "
                                    "the conversation before was cheaper).", ["outcome"], registry=registry)
        self.kv_forgotten = Counter("switchboard_router_kv_forgotten",
                                    "Sessions the kv_aware index stopped placing on a shard because that shard "
                                    "reported the prompt's KV evicted.", registry=registry)
        self.zone_decisions = Counter(
            "switchboard_router_zone_decisions",
            "Routing decisions where the healthy shards span zones, by locality: local (own zone), spill "
            "(own zone too loaded: all zones), remote (no healthy shard in the own zone).", ["locality"],
            registry=registry)


@dataclass
class _Health:
    failures: int = 0
    ejected_until: float = 0.0
    ejections: int = 0
    probing: bool = False  # half-open: one probe request in flight


POLICIES: dict[str, Callable[[float, random.Random], Policy]] = {
    "affinity": lambda eps, rng: AffinityPolicy(eps, rng),
    "least_loaded": lambda eps, rng: LeastLoadedPolicy(rng),
    "kv_aware": lambda eps, rng: KVAwarePolicy(eps, rng),
}

_NOTHING: frozenset[str] = frozenset()


class Router:
    def __init__(
        self,
        membership: MembershipView,
        metrics: RouterMetrics,
        *,
        policy: str = "affinity",
        epsilon: float = 0.25,
        eject_after: int = 3,
        eject_s: float = 5.0,
        max_eject_s: float = 60.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        zone: str | None = None,
        zone_slack: float = 0.25,
    ) -> None:
        """`zone`: this router's zone; it then prefers shards announcing the same zone and spills
        to other zones only when its own has none healthy or is loaded past `zone_slack`
        (data_plane/membership/placement.py: :func:`spills`). None: zones are ignored.

        A view with ``subscribe`` (the registry and Consul watchers, StaticMembership) is read
        once per change; one without is asked per decision and compared with the last list."""
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {sorted(POLICIES)}")
        self.membership = membership
        self.metrics = metrics
        self.policy = POLICIES[policy](epsilon, rng or random.Random())
        self.eject_after = eject_after
        self.eject_s = eject_s
        self.max_eject_s = max_eject_s
        self.clock = clock
        self.zone = zone
        self.zone_slack = zone_slack
        self._health: dict[str, _Health] = {}
        self.fleet = ShardFleet()
        """The incremental view every decision reads (data_plane/routing/fleet.py)."""
        self._stale = True
        subscribe = getattr(membership, "subscribe", None)
        self._subscribed = subscribe is not None
        if subscribe is not None:
            subscribe(self.on_membership_change)
        reports = self.kv_reports
        if reports is not None:
            reports.on_forgotten = self._kv_forgotten
        self._decided = {name: metrics.decisions.labels(name) for name in ("probe", "least_loaded", self.policy.name)}
        self._healthy_gauge = metrics.shards.labels("healthy")
        self._ejected_gauge = metrics.shards.labels("ejected")

    # -- choosing ---------------------------------------------------------------------------

    def shards(self) -> list[Member]:
        return self.membership.members(SHARD_SERVICE)

    def on_membership_change(self) -> None:
        """Subscribed to the membership view: the next decision re-reads the shard list (once)."""
        self._stale = True

    def _refresh(self) -> ShardFleet:
        fleet = self.fleet
        if self._stale or not self._subscribed:
            self._stale = False
            if fleet.sync(self.membership.members(SHARD_SERVICE)):
                for gone in [mid for mid in self._health if mid not in fleet.by_id]:
                    del self._health[gone]
                log.info("routing view: %d shards (change %d)", len(fleet), fleet.changes)
        return fleet

    def pick(self, session_id: str | None, exclude: set[str] | frozenset[str] = _NOTHING) -> Member:
        fleet = self._refresh()
        skip, probe = self._unhealthy(exclude)
        excluded = sum(1 for mid in exclude if mid in fleet.by_id and mid not in skip) if exclude else 0
        healthy = len(fleet) - excluded - len(skip)
        self._healthy_gauge.set(healthy)
        self._ejected_gauge.set(len(skip))
        if probe is not None:
            # Half-open: an ejected shard whose time is up gets exactly one probe request.
            self._health[probe].probing = True
            log.info("probing ejected shard %s (half-open)", probe)
            trace.get_current_span().add_event("router.probe", {"shard": probe})
            self._decided["probe"].inc()
            return fleet.by_id[probe]
        if healthy <= 0:
            known = len(fleet)
            raise NoHealthyBackend(
                "no healthy inference shard is available" + (f" ({known} known, all failing)" if known else ""),
                retry_after=2,
            )
        if excluded:
            skip = skip | {mid for mid in exclude if mid in fleet.by_id}
        scope = self._zone_scope(fleet, skip) if self.zone is not None else fleet.scope(skip)
        chosen = self.policy.choose(scope, session_id)
        self._decided[self.policy.name if session_id else "least_loaded"].inc()
        outcome = getattr(self.policy, "last_outcome", None)
        if session_id and outcome is not None:
            self.metrics.kv_decisions.labels(outcome).inc()
            trace.get_current_span().set_attribute("switchboard.router.expected_cached_tokens",
                                                   getattr(self.policy, "last_expected_cached", 0))
        return chosen

    def _unhealthy(self, exclude: set[str] | frozenset[str]) -> tuple[frozenset[str] | set[str], str | None]:
        """Shards out of routing (ejected or failing past the threshold), and the one to probe.
        Reads only the health entries (shards with recent failures), never the whole fleet."""
        if not self._health:
            return _NOTHING, None
        now = self.clock()
        out: set[str] = set()
        probe: str | None = None
        for mid, h in self._health.items():
            if (h.failures < self.eject_after and h.ejected_until == 0.0) or mid in exclude \
                    or mid not in self.fleet.by_id:
                continue
            out.add(mid)
            if now >= h.ejected_until and not h.probing and (probe is None or mid < probe):
                probe = mid
        return out, probe

    def observe_kv(self, session_id: str | None, member_id: str, tokens: int, chain: str | None = None) -> None:
        """A session's turn was routed to `member_id` with `tokens` of prompt: its KV will be there
        (`chain`: the shard's id for the prompt's last block, so an eviction report can name it)."""
        observe = getattr(self.policy, "observe", None)
        if session_id and observe is not None:
            observe(session_id, member_id, tokens, chain)

    def _kv_forgotten(self, sessions: int) -> None:
        self.metrics.kv_forgotten.inc(sessions)
        log.info("kv_aware: %d session(s) forgotten on their holder after its eviction report", sessions)

    @property
    def kv_reports(self) -> KVReports | None:
        """The kv_aware policy's reader of shards' eviction reports (None for other policies)."""
        return getattr(self.policy, "reports", None)

    def _zone_scope(self, fleet: ShardFleet, skip: frozenset[str] | set[str]) -> Scope:
        counts = {z: len(ms) for z, ms in fleet.zone_members.items()}
        loads = dict(fleet.zone_load)
        for mid in skip:
            z = fleet.zone_of.get(mid)
            if z is not None:
                counts[z] -= 1
                loads[z] -= fleet.loads.get(mid, 0)
        present = [z for z, n in counts.items() if n > 0]
        if len(present) < 2 and self.zone in present:
            return fleet.scope(skip)  # one zone, ours: nothing to decide
        mine = counts.get(self.zone or "", 0)
        rest = sum(counts[z] for z in present) - mine
        if mine <= 0 or (rest > 0 and spills(loads.get(self.zone or "", 0) / mine,
                                              sum(loads[z] for z in present if z != self.zone) / rest,
                                              self.zone_slack)):
            locality = "remote" if mine <= 0 else "spill"
            self.metrics.zone_decisions.labels(locality).inc()
            trace.get_current_span().set_attribute("switchboard.router.locality", locality)
            return fleet.scope(skip)
        self.metrics.zone_decisions.labels("local").inc()
        return fleet.scope(skip, self.zone)

    @contextmanager
    def lease(self, member: Member) -> Iterator[None]:
        self.fleet.acquire(member.id)
        self.metrics.outstanding.inc()
        try:
            yield
        finally:
            self.fleet.release(member.id)
            self.metrics.outstanding.dec()

    def load(self, member_id: str) -> int:
        return self.fleet.loads.get(member_id, 0)

    # -- health -----------------------------------------------------------------------------

    def report_success(self, member: Member) -> None:
        h = self._health.get(member.id)
        if h is None:
            return
        if h.ejected_until:
            log.info("shard %s passed its probe; back in routing", member.id)
            trace.get_current_span().add_event("router.restored", {"shard": member.id})
        del self._health[member.id]

    def report_failure(self, member: Member, reason: str) -> None:
        self.metrics.failures.labels(reason).inc()
        h = self._health.setdefault(member.id, _Health())
        h.failures += 1
        was_probe = h.probing
        h.probing = False
        if h.failures >= self.eject_after or was_probe:
            h.ejections += 1
            hold = min(self.max_eject_s, self.eject_s * 2 ** (h.ejections - 1))
            h.ejected_until = self.clock() + hold
            self.metrics.ejections.inc()
            log.warning("ejecting shard %s for %.1f s after %d consecutive failures (last: %s)",
                        member.id, hold, h.failures, reason)
            trace.get_current_span().add_event(
                "router.eject", {"shard": member.id, "reason": reason, "hold_s": hold})

    def record_retry(self, member: Member, reason: str) -> None:
        self.metrics.retries.labels(reason).inc()
        log.warning("retrying request on another shard after %s failed (%s)", member.id, reason)
        trace.get_current_span().add_event("router.retry", {"failed_shard": member.id, "reason": reason})

    def record_resume(self, member: Member, reason: str) -> None:
        self.metrics.resumes.labels(reason).inc()
        log.warning("stream from %s broke mid-way (%s); resuming on another shard", member.id, reason)
        trace.get_current_span().add_event("router.resume", {"failed_shard": member.id, "reason": reason})

    def is_ejected(self, member_id: str) -> bool:
        h = self._health.get(member_id)
        return h is not None and h.ejected_until > 0.0
