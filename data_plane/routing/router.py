"""Shard choice and shard health: affinity with bounded loads, power of two choices, ejection.

    router = Router(membership, RouterMetrics(registry))
    shard = router.pick(session_id="s-123", exclude=set())     # raises NoHealthyBackend
    with router.lease(shard):                                  # counts outstanding requests
        ...                                                    # call the shard
    router.report_success(shard)   /   router.report_failure(shard, FailureReason.CONNECT)

Policies (by name, :data:`POLICIES`; data_plane/routing/policies.py): a request with a session goes to its shard on a
consistent-hash ring with bounded loads (no shard above ``ceil((1+eps) * mean)``
outstanding), so its prefix stays warm where possible; one without a session takes the
less loaded of two random shards (least outstanding requests). ``kv_aware``
(data_plane/routing/kv_routing.py) weighs the shard holding the session's KV against the ring's choice:
expected cached tokens against load, with session affinity as the case where they agree.

Health is passive, Envoy-style outlier detection, one :class:`~data_plane.routing.failures.Circuit`
per shard with recent failures: ``eject_after`` consecutive failures open it (the shard is ejected)
for ``eject_s`` (doubling on repeat, capped), and so does a failure percentage past its threshold over
a sliding window with a minimum request volume, as long as the max ejection percent leaves shards in
routing (data_plane/routing/outliers.py: a lossy link fails every other call, so its failures are
never consecutive); when that expires the next decision sends the shard a
single probe (half-open); success closes the circuit, failure opens it again. Every failure, retry
and state change is a metric (reasons from :class:`~data_plane.routing.failures.FailureReason`,
bounded), a span event on the current span and a log line.

A shard that is slow but fails nothing is handled by latency (data_plane/routing/latency.py, on by
default): ``router.observe_latency(shard, seconds)`` after each first token feeds a peak-EWMA; power of
two choices compares latency x (outstanding + 1), and a session's turn leaves a shard that is a clear
latency outlier for the policy's choice without it (``switchboard_router_latency_spills_total``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from data_plane.common.errors import NoHealthyBackend
from data_plane.membership.placement import spills
from data_plane.membership.view import Member, MembershipView
from data_plane.routing.failures import Circuit, CircuitState, FailureReason
from data_plane.routing.fleet import Scope, ShardFleet
from data_plane.routing.kv_routing import KVAwarePolicy, KVReports
from data_plane.routing.latency import LatencyConfig, ShardLatency, Slowness
from data_plane.routing.outliers import COUNTED, FailurePercentage, OutlierConfig
from data_plane.routing.policies import AffinityPolicy, LeastLoadedPolicy, Policy

log = logging.getLogger(__name__)

SHARD_SERVICE = "shard"


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.retries = Counter("switchboard_router_retries", "Requests retried on another shard.", ["reason"],
                               registry=registry)
        for reason in RETRY_REASONS:  # at 0 from the start: a calm fleet's panel reads 0, not "No data"
            self.retries.labels(reason)
        self.resumes = Counter("switchboard_router_resumes", "Streams resumed on another shard mid-way.",
                               ["reason"], registry=registry)
        # at 0 from the start: an alert's increase() sees the first loss (a series born at 1 shows none)
        self.resumes.labels(FailureReason.PIPELINE_STAGE_LOST)
        self.ejections = Counter("switchboard_router_ejections", "Shards ejected from routing after failures, by "
                                 "reason: consecutive (eject_after failures in a row), failure_percentage "
                                 "(too many of its calls in the outlier window failed) or probe (its probe "
                                 "after an ejection failed).", ["reason"],
                                 registry=registry)
        for why in EJECTION_REASONS:
            self.ejections.labels(why)
        self.failures = Counter("switchboard_router_upstream_failures", "Failed shard calls by reason.",
                                ["reason"], registry=registry)
        self.failures.labels(FailureReason.PIPELINE_STAGE_LOST)  # as resumes': a stage lost before the first token
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
        self.latency_spills = Counter(
            "switchboard_router_latency_spills",
            "Session turns sent away from their shard because it was a latency outlier (its time-to-first-token "
            "estimate far above the other shards'), by reason: outlier (routed elsewhere) or no_alternative "
            "(no other shard in routing: served there as before).", ["reason"], registry=registry)
        for why in LATENCY_SPILL_REASONS:
            self.latency_spills.labels(why)
        self.shard_latency = Gauge(
            "switchboard_router_shard_latency_seconds",
            "This router's peak-EWMA estimate of each shard's time to first token (label: shard id, removed "
            f"when the shard leaves membership; the first {MAX_LATENCY_SERIES} shards only).", ["shard"],
            registry=registry)


POLICIES: dict[str, Callable[[float, random.Random], Policy]] = {
    "affinity": lambda eps, rng: AffinityPolicy(eps, rng),
    "least_loaded": lambda eps, rng: LeastLoadedPolicy(rng),
    "kv_aware": lambda eps, rng: KVAwarePolicy(eps, rng),
}

_NOTHING: frozenset[str] = frozenset()
RETRY_REASONS = tuple(FailureReason)[:list(FailureReason).index(FailureReason.STREAM_IDLE)] + (
    FailureReason.PIPELINE_STAGE_LOST,)
"""The reasons a call fails before its first token, so the request is retried elsewhere (failures.py)."""
EJECTION_REASONS = ("consecutive", "failure_percentage", "probe")
LATENCY_SPILL_REASONS = ("outlier", "no_alternative")
MAX_LATENCY_SERIES = 256
"""Shards with a latency gauge series per router (bounded: a 10,000-shard fleet gets no 10,000 series)."""


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
        outliers: OutlierConfig | None = None,
        latency: LatencyConfig | None = None,
    ) -> None:
        """`zone`: this router's zone; it then prefers shards announcing the same zone and spills
        to other zones only when its own has none healthy or is loaded past `zone_slack`
        (data_plane/membership/placement.py: :func:`spills`). None: zones are ignored.

        A view with ``subscribe`` (the registry and Consul watchers, StaticMembership) is read
        once per change; one without is asked per decision and compared with the last list.
        `outliers`: failure-percentage ejection (data_plane/routing/outliers.py; threshold 0: off).
        `latency`: latency-aware choice (data_plane/routing/latency.py; enabled=False: off)."""
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
        self._circuits: dict[str, Circuit] = {}
        self.outliers = FailurePercentage(outliers or OutlierConfig())
        """Shards with recent failures; a shard without an entry is CLOSED."""
        self.fleet = ShardFleet()
        """The incremental view every decision reads (data_plane/routing/fleet.py)."""
        latency = latency or LatencyConfig()
        self.latency: ShardLatency | None = ShardLatency(latency, clock) if latency.enabled else None
        """Per-shard time-to-first-token estimates (None: latency-aware routing off)."""
        if self.latency is not None:
            self.fleet.cost = self.latency.cost
        self._slow: set[str] = set()
        """Shards whose sessions are being sent elsewhere (logged on entry and exit, not per request)."""
        self._gauged: set[str] = set()
        self._gauged_at = -1e18
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
                for gone in [mid for mid in self._circuits if mid not in fleet.by_id]:
                    del self._circuits[gone]
                self.outliers.keep_only(fleet.by_id)
                if self.latency is not None:
                    self.latency.keep_only(fleet.by_id)
                    self._slow.intersection_update(fleet.by_id)
                    for gone in [sid for sid in self._gauged if sid not in fleet.by_id]:
                        self._gauged.discard(gone)
                        self.metrics.shard_latency.remove(gone)
                log.info("routing view: %d shards (change %d)", len(fleet), fleet.changes)
        return fleet

    def shard_ids(self) -> set[str]:
        """The ids of the shards membership lists now (routable or not for the circuits)."""
        return set(self._refresh().by_id)

    def pick(self, session_id: str | None, exclude: set[str] | frozenset[str] = _NOTHING) -> Member:
        fleet = self._refresh()
        skip, probe = self._unhealthy(exclude)
        excluded = sum(1 for mid in exclude if mid in fleet.by_id and mid not in skip) if exclude else 0
        healthy = len(fleet) - excluded - len(skip)
        self._healthy_gauge.set(healthy)
        self._ejected_gauge.set(len(skip))
        if probe is not None:
            # Half-open: an ejected shard whose time is up gets exactly one probe request.
            self._transition(probe, self._circuits[probe], CircuitState.HALF_OPEN)
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
        if session_id and self.latency is not None:
            chosen = self._avoid_slow(fleet, scope, skip, chosen, session_id)
        self._decided[self.policy.name if session_id else "least_loaded"].inc()
        outcome = getattr(self.policy, "last_outcome", None)
        if session_id and outcome is not None:
            self.metrics.kv_decisions.labels(outcome).inc()
            trace.get_current_span().set_attribute("switchboard.router.expected_cached_tokens",
                                                   getattr(self.policy, "last_expected_cached", 0))
        return chosen

    def _avoid_slow(self, fleet: ShardFleet, scope: Scope, skip: frozenset[str] | set[str], chosen: Member,
                    session_id: str) -> Member:
        """`chosen` for a session, unless it is a latency outlier: then the policy's choice without it, as the
        bounded-load spill does (the session's transcript and KV come from the cache tier there)."""
        assert self.latency is not None
        slow = self.latency.outlier(chosen.id)
        if slow is None:
            if chosen.id in self._slow:
                self._slow.discard(chosen.id)
                log.info("shard %s is no latency outlier any more; its sessions stay on it", chosen.id)
            return chosen
        without = set(skip) | {chosen.id}
        other = fleet.scope(without, scope.zone)
        if other.n <= 0 and scope.zone is not None:
            other = fleet.scope(without)
        if other.n <= 0:
            self._latency_spill(chosen, slow, None)
            return chosen
        spilled = self.policy.choose(other, session_id)
        self._latency_spill(chosen, slow, spilled)
        return spilled

    def _latency_spill(self, slow_shard: Member, slow: Slowness, to: Member | None) -> None:
        why = "outlier" if to is not None else "no_alternative"
        self.metrics.latency_spills.labels(why).inc()
        trace.get_current_span().add_event("router.latency_spill", {
            "shard": slow_shard.id, "to": to.id if to is not None else "", "reason": why,
            "estimate_s": round(slow.estimate_s, 3), "median_s": round(slow.median_s, 3)})
        if slow_shard.id not in self._slow:
            self._slow.add(slow_shard.id)
            log.warning("shard %s is a latency outlier (time to first token ~%.2f s, other shards' median "
                        "%.2f s): its sessions go to other shards until it is fast again", slow_shard.id,
                        slow.estimate_s, slow.median_s)

    def observe_latency(self, member: Member, seconds: float) -> None:
        """`member` took `seconds` from the request to its first token (the upstream calls this)."""
        if self.latency is None or member.id not in self._refresh().by_id:
            return  # a stream that outlived its shard's membership: nothing to route by any more
        self.latency.observe(member.id, seconds)
        now = self.clock()
        if now - self._gauged_at >= self.latency.config.refresh_s:
            self._gauged_at = now
            for sid, est in self.latency.snapshot().items():
                if sid in self._gauged or len(self._gauged) < MAX_LATENCY_SERIES:
                    self._gauged.add(sid)
                    self.metrics.shard_latency.labels(sid).set(est)

    def _unhealthy(self, exclude: set[str] | frozenset[str]) -> tuple[frozenset[str] | set[str], str | None]:
        """Shards out of routing (circuit open or half-open), and the one to probe.
        Reads only the circuits (shards with recent failures), never the whole fleet."""
        if not self._circuits:
            return _NOTHING, None
        now = self.clock()
        out: set[str] = set()
        probe: str | None = None
        for mid, circuit in self._circuits.items():
            if circuit.state is CircuitState.CLOSED or mid in exclude or mid not in self.fleet.by_id:
                continue
            out.add(mid)
            if circuit.probe_due(now) and (probe is None or mid < probe):
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
        circuit = self._circuits.get(member.id)
        if circuit is not None and circuit.ignores_success():
            return
        if self.outliers.enabled:
            self.outliers.record(member.id, False, self.clock())
        if circuit is not None:
            self._transition(member.id, circuit, CircuitState.CLOSED)

    def report_failure(self, member: Member, reason: FailureReason) -> None:
        reason = FailureReason(reason)  # a value outside the enum is a bug, never a new label
        self.metrics.failures.labels(reason).inc()
        circuit = self._circuits.setdefault(member.id, Circuit())
        circuit.failures += 1
        outlier = reason in COUNTED and self.outliers.record(member.id, True, self.clock())
        if circuit.state is CircuitState.OPEN:
            # A call routed before the ejection (nothing is routed to an OPEN shard): the same outage, so the
            # hold restarts from now at its length, not doubled. The streams one blip broke all fail
            # together, and each doubled it (3 then 6, 12, 24 s after six) for a shard healthy again.
            self._extend(member.id, circuit)
        elif circuit.state is CircuitState.HALF_OPEN:
            self._transition(member.id, circuit, CircuitState.OPEN, reason, "probe")
        elif circuit.failures >= self.eject_after:
            self._transition(member.id, circuit, CircuitState.OPEN, reason)
        elif outlier and circuit.state is CircuitState.CLOSED and self._may_eject_outlier():
            self._transition(member.id, circuit, CircuitState.OPEN, reason, "failure_percentage")

    def _extend(self, member_id: str, circuit: Circuit) -> None:
        """An OPEN circuit's hold restarted from now, at the length it was opened with (no new ejection)."""
        hold = min(self.max_eject_s, self.eject_s * 2 ** max(0, circuit.openings - 1))
        circuit.open_until = max(circuit.open_until, self.clock() + hold)
        self.outliers.forget(member_id)

    def _may_eject_outlier(self) -> bool:
        fleet = self._refresh()
        out = sum(1 for mid, c in self._circuits.items() if c.state is not CircuitState.CLOSED and mid in fleet.by_id)
        return self.outliers.may_eject(len(fleet), out)

    def circuit_state(self, member_id: str) -> CircuitState:
        circuit = self._circuits.get(member_id)
        return CircuitState.CLOSED if circuit is None else circuit.state

    def _transition(self, member_id: str, circuit: Circuit, state: CircuitState,
                    reason: FailureReason | None = None, why: str = "consecutive") -> None:
        """Every circuit change, with its log line, span event and metric (`why`: an ejection's cause,
        one of :data:`EJECTION_REASONS`)."""
        span = trace.get_current_span()
        if state is CircuitState.OPEN:
            hold = min(self.max_eject_s, self.eject_s * 2 ** circuit.openings)
            now = self.clock()
            calls, failures = self.outliers.rate(member_id, now)
            circuit.transition_to(state, now=now, hold_s=hold)
            self.outliers.forget(member_id)  # judged anew once back
            self.metrics.ejections.labels(why).inc()
            if why == "probe":
                log.warning("ejecting shard %s again for %.1f s: its probe failed (%s)", member_id, hold, reason)
            elif why == "failure_percentage":
                log.warning("ejecting shard %s for %.1f s: %d of its %d calls in the last %.0f s failed "
                            "(%.0f%%, threshold %.0f%%; last: %s)", member_id, hold, failures, calls,
                            self.outliers.config.window_s, 100.0 * failures / max(1, calls),
                            self.outliers.config.threshold, reason)
            else:
                log.warning("ejecting shard %s for %.1f s after %d consecutive failures (last: %s)",
                            member_id, hold, circuit.failures, reason)
            span.add_event("router.eject", {"shard": member_id, "reason": str(reason), "cause": why, "hold_s": hold})
        elif state is CircuitState.HALF_OPEN:
            circuit.transition_to(state)
            log.info("probing ejected shard %s (half-open)", member_id)
            span.add_event("router.probe", {"shard": member_id})
        else:
            if circuit.state is not CircuitState.CLOSED:
                log.info("shard %s passed its probe; back in routing", member_id)
                span.add_event("router.restored", {"shard": member_id})
            del self._circuits[member_id]  # CLOSED with no failures: no entry

    def record_retry(self, member: Member, reason: FailureReason) -> None:
        reason = FailureReason(reason)
        self.metrics.retries.labels(reason).inc()
        log.warning("retrying request on another shard after %s failed (%s)", member.id, reason)
        trace.get_current_span().add_event("router.retry", {"failed_shard": member.id, "reason": str(reason)})

    def record_resume(self, member: Member, reason: FailureReason) -> None:
        reason = FailureReason(reason)
        self.metrics.resumes.labels(reason).inc()
        log.warning("stream from %s broke mid-way (%s); resuming on another shard", member.id, reason)
        trace.get_current_span().add_event("router.resume", {"failed_shard": member.id, "reason": str(reason)})

    def is_ejected(self, member_id: str) -> bool:
        return self.circuit_state(member_id) is not CircuitState.CLOSED
