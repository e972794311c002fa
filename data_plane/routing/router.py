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
from data_plane.routing.kv_routing import KVAwarePolicy
from data_plane.routing.policies import AffinityPolicy, LeastLoadedPolicy, Policy
from data_plane.membership.view import Member, MembershipView
from data_plane.membership.placement import prefer_zone

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
                                    "no known KV; holder_overloaded: recomputed elsewhere).", ["outcome"],
                                    registry=registry)
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
        (data_plane/membership/placement.py: :func:`prefer_zone`). None: zones are ignored."""
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
        self._loads: dict[str, int] = {}

    # -- choosing ---------------------------------------------------------------------------

    def shards(self) -> list[Member]:
        return self.membership.members(SHARD_SERVICE)

    def pick(self, session_id: str | None, exclude: set[str] | frozenset[str] = frozenset()) -> Member:
        now = self.clock()
        members = [m for m in self.shards() if m.id not in exclude]
        healthy, probes = [], []
        for m in members:
            h = self._health.get(m.id)
            if h is None or (h.failures < self.eject_after and h.ejected_until == 0.0):
                healthy.append(m)
            elif now >= h.ejected_until and not h.probing:
                probes.append(m)
        self._update_gauges(members, healthy)
        if probes:
            # Half-open: an ejected shard whose time is up gets exactly one probe request.
            probe = probes[0]
            self._health[probe.id].probing = True
            log.info("probing ejected shard %s (half-open)", probe.id)
            trace.get_current_span().add_event("router.probe", {"shard": probe.id})
            self.metrics.decisions.labels("probe").inc()
            return probe
        if not healthy:
            known = len(self.shards())
            raise NoHealthyBackend(
                "no healthy inference shard is available" + (f" ({known} known, all failing)" if known else ""),
                retry_after=2,
            )
        if self.zone is not None:
            healthy = self._zone_candidates(healthy)
        chosen = self.policy.choose(healthy, session_id, self._loads)
        self.metrics.decisions.labels(self.policy.name if session_id else "least_loaded").inc()
        outcome = getattr(self.policy, "last_outcome", None)
        if session_id and outcome is not None:
            self.metrics.kv_decisions.labels(outcome).inc()
            trace.get_current_span().set_attribute("switchboard.router.expected_cached_tokens",
                                                   getattr(self.policy, "last_expected_cached", 0))
        return chosen

    def observe_kv(self, session_id: str | None, member_id: str, tokens: int) -> None:
        """A session's turn was routed to `member_id` with `tokens` of prompt: its KV will be there."""
        observe = getattr(self.policy, "observe", None)
        if session_id and observe is not None:
            observe(session_id, member_id, tokens)

    def _zone_candidates(self, healthy: list[Member]) -> list[Member]:
        zone_of = {m.id: m.zone for m in healthy}
        if len(set(zone_of.values())) < 2 and self.zone in zone_of.values():
            return healthy  # one zone, ours: nothing to decide
        keep = prefer_zone({m.id: self._loads.get(m.id, 0) for m in healthy}, zone_of, self.zone or "",
                           self.zone_slack)
        if keep is None:
            locality = "remote" if self.zone not in zone_of.values() else "spill"
            self.metrics.zone_decisions.labels(locality).inc()
            trace.get_current_span().set_attribute("switchboard.router.locality", locality)
            return healthy
        self.metrics.zone_decisions.labels("local").inc()
        return [m for m in healthy if m.id in keep]

    @contextmanager
    def lease(self, member: Member) -> Iterator[None]:
        self._loads[member.id] = self._loads.get(member.id, 0) + 1
        self.metrics.outstanding.inc()
        try:
            yield
        finally:
            self._loads[member.id] -= 1
            self.metrics.outstanding.dec()

    def load(self, member_id: str) -> int:
        return self._loads.get(member_id, 0)

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

    def _update_gauges(self, members: list[Member], healthy: list[Member]) -> None:
        self.metrics.shards.labels("healthy").set(len(healthy))
        self.metrics.shards.labels("ejected").set(len(members) - len(healthy))
