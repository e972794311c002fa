"""Priority admission: a bounded number of requests in flight to shards; the rest wait by tier.

    admission = Admission(AdmissionMetrics(registry), AdmissionConfig(), capacity=lambda: 32)
    ticket = await admission.acquire(tier, policy, tenant="acme", tokens=prompt + max_tokens, slots=n)
    try:                                      # (waits its turn; Overloaded (503 + Retry-After) if shed)
        ...                                   # call a shard, stream the answer
    finally:
        ticket.release(used_tokens)           # the real prompt + output tokens, when known

Capacity is the number of requests this gateway lets in flight to shards at once: a flag,
or by default the batch slots its shards announce (membership meta ``max_num_seqs``) times
``inflight_per_slot``. With no shard known it is unbounded, so the router answers at once
(no_healthy_backend) instead of requests waiting for nothing. A request takes one slot per choice it
asks for (``n``): a shard decodes each choice as its own sequence in its batch. Counted as one, a
free key's three ``n: 8`` requests held 24 sequences on a 16-slot shard, past the reserve left for the
tiers above, and an enterprise request waited ~10 s for its first token (0.2 s unloaded). A request
asking more slots than its tier may fill takes the whole of it (it starts once nothing is in flight).

Order. Waiters are served by tier priority (lower first); within one priority level, by fair
share between tenants (data_plane/gateway/fair_share.py: the tenant with the least recent service, counted
in prompt + output tokens, goes first; a tenant's own requests in arrival order), so one tenant
flooding the free tier does not starve the other free users. Fair order alone still makes a
light tenant wait for one of the flood's requests to finish, so while more than one tenant of a
tier has been active lately (``tenant_window_s``), a tenant that already has a request in flight
leaves the last ``tenant_headroom`` slots of its tier's share to tenants with none: the light
tenant finds a slot free. A tenant alone in its tier uses the whole share. A tier may only
fill part of the capacity: each priority level below the best leaves ``reserve`` of it for
the levels above (by default free 75 %, plus 87.5 %, enterprise 100 %). That headroom is what
keeps enterprise time-to-first-token near its unloaded value under saturation: the engine
does not preempt, so a request that finds every batch slot taken waits for one to finish,
however high its priority; with the reserve a slot is usually free for it.

Shedding, with 503 ``overloaded`` and ``Retry-After`` (when a slot for the request's tier is likely free,
estimated from the hold times of the slots: data_plane/gateway/slot_wait.py):

- ``deadline``: a waiter still queued at its tier's deadline. The deadline is
  ``queue_timeout_s`` for the tier shed first and grows with each later shed level
  (free 5 s, plus 10 s, enterprise 15 s by default), or as set per tier.
- ``queue_full``: more than ``queue_size`` waiters; of the tier that is shed first (lowest
  ``shed_order``), the newest waiter of the tenant with the most service goes, which may be the
  newcomer itself. So free is shed before plus, enterprise last, and a flood before a light user.

One gateway's admission knows nothing of other gateways: with N gateways, set
``--max-inflight`` (or ``--inflight-per-slot 1/N``) so their sum fits the shards.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.common.errors import Overloaded
from data_plane.gateway.fair_share import FairShare
from data_plane.gateway.slot_wait import SlotHolds
from data_plane.tiers import Tier, TierPolicy

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

DEFAULT_SLOTS_PER_SHARD = 16
"""Batch slots assumed for a shard that does not announce ``max_num_seqs``."""
SHED_REASONS = ("deadline", "queue_full")
"""switchboard_admission_shed_total's reason label: `_expire` and `_shed_one`."""
WAIT_BUCKETS = (0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = Gauge("switchboard_admission_queue_depth",
                                 "Requests waiting for admission to a shard.", ["tier"], registry=registry)
        self.wait = Histogram("switchboard_admission_wait_seconds",
                              "Time admitted requests waited in the queue.", ["tier"], buckets=WAIT_BUCKETS,
                              registry=registry)
        self.shed = Counter("switchboard_admission_shed",
                            "Requests shed by admission (503), by reason (deadline|queue_full).",
                            ["tier", "reason"], registry=registry)
        self.inflight = Gauge("switchboard_admission_inflight",
                              "Batch slots this gateway's requests hold on shards (a request holds one "
                              "per choice, n).", registry=registry)
        self.capacity = Gauge("switchboard_admission_capacity",
                              "Batch slots this gateway lets its requests hold on shards at once "
                              "(-1: unbounded, no shard known).", registry=registry)
        self.tenant_service = Gauge("switchboard_admission_tenant_service_tokens",
                                    "Tokens (prompt + output) served per tenant since the gateway started, as "
                                    "counted for fair share: the top N tenants of each tier, the rest as "
                                    "tenant=\"other\".", ["tier", "tenant"], registry=registry)

    def show_tiers(self, tiers: Iterable[str]) -> None:
        """Each tier's queue depth and shed counters at 0 from the start (gateway runtime's show_policy): a
        panel of an idle fleet reads 0, not "No data"."""
        for tier in tiers:
            self.queue_depth.labels(tier)
            for reason in SHED_REASONS:
                self.shed.labels(tier, reason)


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 0
    """Requests in flight to shards per gateway; 0 = shard slots x inflight_per_slot."""
    inflight_per_slot: float = 1.0
    """In-flight requests per announced batch slot when max_inflight is 0 (> 0)."""
    reserve: float = 0.125
    """Share of capacity each priority level leaves to the levels above it (0 <= r < 1)."""
    queue_size: int = 512
    """Most requests waiting at once; beyond it the lowest tier's newest is shed."""
    queue_timeout_s: float = 5.0
    """Deadline in the queue for the tier shed first; the k-th shed level waits k times as long."""
    queue_timeouts: Mapping[str, float] = field(default_factory=dict)
    """Per-tier deadlines that override the rule above."""
    retry_after_min_s: float = 1.0
    """Least Retry-After sent with a shed request (the estimate when nothing holds the slots long)."""
    retry_after_max_s: float = 60.0
    """Most Retry-After sent with a shed request (the openai SDKs honour at most 60 s)."""
    tenant_top_n: int = 20
    """Tenants per tier with their own series in the fair-share service metric (>= 1); the rest are `other`."""
    tenant_headroom: int = 1
    """Slots of a tier's share that a tenant with a request in flight leaves to tenants of the tier with
    none, while another tenant of the tier has been active lately (0 = off)."""
    tenant_window_s: float = 30.0
    """How long a tenant counts as active in its tier after its last admitted request."""

    def __post_init__(self) -> None:
        if self.max_inflight < 0 or self.inflight_per_slot <= 0 or not 0 <= self.reserve < 1:
            raise ValueError("admission: max_inflight >= 0, inflight_per_slot > 0 and 0 <= reserve < 1")
        timeouts = [self.queue_timeout_s, *self.queue_timeouts.values()]
        if self.queue_size < 0 or any(t <= 0 for t in timeouts) or self.tenant_top_n < 1:
            raise ValueError("admission: queue_size >= 0, queue timeouts > 0 and tenant_top_n >= 1")
        if self.tenant_headroom < 0 or self.tenant_window_s <= 0:
            raise ValueError("admission: tenant_headroom >= 0 and tenant_window_s > 0")
        if not 0 < self.retry_after_min_s <= self.retry_after_max_s:
            raise ValueError("admission: 0 < retry_after_min_s <= retry_after_max_s")


def shard_capacity(slots: Iterable[str | None], config: AdmissionConfig) -> int | None:
    """Capacity from the shards' announced ``max_num_seqs`` (None when no shard is known)."""
    if config.max_inflight:
        return config.max_inflight
    announced = [int(s) if s and str(s).isdigit() else DEFAULT_SLOTS_PER_SHARD for s in slots]
    if not announced:
        return None
    return max(1, math.floor(sum(announced) * config.inflight_per_slot))


class Ticket:
    """One admitted request's slot; `release()` it exactly when the request leaves the shard
    (more calls are no-ops), with the tokens it really used (prompt + output) when known, so the
    tenant's fair-share counter is settled. A ticket dropped unreleased frees its slot when collected."""

    __slots__ = ("_admission", "_loop", "_released", "charged", "hold_id", "slots", "tenant", "tier")

    def __init__(self, admission: Admission, tier: str, tenant: str = "", charged: int = 0, slots: int = 1,
                 hold_id: int = -1) -> None:
        self.tier = tier
        self.tenant = tenant
        self.charged = charged
        """Tokens charged to the tenant at admission (the estimate)."""
        self.slots = slots
        """Batch slots held (the request's choices, at most its tier's cap)."""
        self.hold_id = hold_id
        self._admission = admission
        self._released = False
        self._loop = asyncio.get_running_loop()

    def release(self, used_tokens: int | None = None) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self, used_tokens)

    def __del__(self) -> None:
        if not self._released:  # e.g. a stream never started: a leaked slot would shrink capacity for good
            try:
                self._loop.call_soon_threadsafe(self.release)
            except RuntimeError:  # the loop is closed: nothing left to admit
                pass


@dataclass(eq=False)
class _Waiter:
    tier: Tier
    rank: int
    """How many priority levels of the policy are above this tier's (0 = the best)."""
    seq: int
    enqueued: float
    future: asyncio.Future[Ticket]
    tenant: str = ""
    tokens: int = 0
    slots: int = 1
    """Batch slots the request asks for: its choices (n)."""
    gone: bool = False
    """Admitted, shed or cancelled: no longer in the queue."""
    shed_reason: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.tier.name, self.tenant)


class Admission:
    """See the module docstring. All state changes happen without an await, so no lock."""

    def __init__(self, metrics: AdmissionMetrics, config: AdmissionConfig, *,
                 capacity: Callable[[], int | None], clock: Callable[[], float] = time.monotonic,
                 fair_share: FairShare | None = None) -> None:
        self.metrics = metrics
        self.config = config
        self._capacity = capacity
        self._clock = clock
        self.fair_share = fair_share or FairShare(metrics.tenant_service, top_n=config.tenant_top_n)
        # priority -> (tier, tenant) -> that tenant's waiters in arrival order
        self._queues: dict[int, dict[tuple[str, str], deque[_Waiter]]] = {}
        self._seq = itertools.count()
        self._inflight = 0
        self._depth: dict[str, int] = defaultdict(int)
        self._tenant_inflight: dict[tuple[str, str], int] = defaultdict(int)
        self._recent: dict[str, OrderedDict[str, float]] = defaultdict(OrderedDict)
        """tier -> tenant -> when its last request was admitted (oldest first; pruned past the window)."""
        self.holds = SlotHolds(config.retry_after_min_s, config.retry_after_max_s)
        """The slots held and for how long they are held: the shed requests' Retry-After."""

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def waiting(self) -> int:
        return sum(self._depth.values())

    def capacity(self) -> int | None:
        return self._capacity()

    async def acquire(self, tier: Tier, policy: TierPolicy, *, tenant: str = "", tokens: int = 0,
                      slots: int = 1) -> Ticket:
        """Wait for `slots` slots (the request's choices, n) in priority order, fair share between tenants
        within a level; raise :class:`Overloaded` when shed.

        `policy` is the tier policy in force for this request: it places `tier` among the others.
        `tokens` (the prompt plus the output reserved) is charged to `tenant` when admitted and
        settled to the real usage by ``Ticket.release(used_tokens)``."""
        with tracer.start_as_current_span("admission.queue") as span:
            loop = asyncio.get_running_loop()
            tiers = [policy.get(name) for name in policy.names()]
            for t in tiers:  # every tier's depth from the first request on, at 0: a queue never formed read "No data"
                if t.name not in self._depth:
                    self._set_depth(t.name, 0)
            rank = len({t.priority for t in tiers if t.priority < tier.priority})
            self.fair_share.arrive(tier.name, tenant, tier.priority)
            slots = max(1, slots)
            capacity = self._capacity_now()
            if self.waiting == 0 and self._fits(rank, capacity, tier.name, tenant, slots):  # no queue
                span.set_attributes({"switchboard.admission.queue_depth": 0,
                                     "switchboard.admission.outcome": "admitted", "switchboard.admission.wait_s": 0.0})
                return self._start(tier.name, 0.0, tenant, tokens, self._held(rank, capacity, slots))
            w = _Waiter(tier, rank, next(self._seq), self._clock(), loop.create_future(), tenant, tokens, slots)
            span.set_attribute("switchboard.admission.queue_depth", self.waiting)
            self._queues.setdefault(tier.priority, {}).setdefault(w.key, deque()).append(w)
            self._set_depth(tier.name, +1)
            self._dispatch()
            if not w.future.done() and self.waiting > self.config.queue_size:
                self._shed_one()
            timer = None
            if not w.future.done():
                timer = loop.call_later(self.timeout_s(tier, tiers), self._expire, w)
            try:
                ticket = await w.future
            except asyncio.CancelledError:
                if not w.gone:
                    self._remove(w)
                    self.fair_share.leave(tier.name, tenant)
                elif w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                    w.future.result().release(0)  # admitted as the caller gave up
                raise
            except Overloaded:
                span.set_attribute("switchboard.admission.outcome", f"shed_{w.shed_reason}")
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            waited = self._clock() - w.enqueued
            span.set_attribute("switchboard.admission.outcome", "admitted")
            span.set_attribute("switchboard.admission.wait_s", waited)
            return ticket

    def timeout_s(self, tier: Tier, tiers: Iterable[Tier]) -> float:
        """The tier's queue deadline: its override, else the base times its place in the shed order."""
        if tier.name in self.config.queue_timeouts:
            return self.config.queue_timeouts[tier.name]
        orders = sorted({t.shed_order for t in tiers} | {tier.shed_order})
        return self.config.queue_timeout_s * (orders.index(tier.shed_order) + 1)

    def cap(self, rank: int, capacity: int) -> int:
        """How many in flight, of `capacity`, still let a tier `rank` levels below the best start one."""
        return max(1, math.floor(capacity * (1 - self.config.reserve * rank) + 1e-9))

    # -- state changes (no awaits below) ------------------------------------------------------

    def _capacity_now(self) -> int | None:
        capacity = self._capacity()
        self.metrics.capacity.set(-1 if capacity is None else capacity)
        return capacity

    def _fits(self, rank: int, capacity: int | None, tier: str, tenant: str, slots: int = 1) -> bool:
        if capacity is None:
            return True
        cap = self.cap(rank, capacity)
        if self._keeps_headroom(tier, tenant):
            cap = max(1, cap - self.config.tenant_headroom)
        return self._inflight + min(slots, cap) <= cap

    def _held(self, rank: int, capacity: int | None, slots: int) -> int:
        """The slots an admitted request holds: its choices, at most its tier's cap (a request asking for
        more than the tier may fill holds all of it, so it never waits for slots that cannot exist)."""
        return slots if capacity is None else min(slots, self.cap(rank, capacity))

    def _keeps_headroom(self, tier: str, tenant: str) -> bool:
        """Whether `tenant` must leave its tier's last slots free: it has a request in flight, and
        another tenant of the tier was admitted within the window."""
        if not self.config.tenant_headroom or not self._tenant_inflight.get((tier, tenant)):
            return False
        recent = self._recent.get(tier)
        if not recent:
            return False
        horizon = self._clock() - self.config.tenant_window_s
        while recent and next(iter(recent.values())) < horizon:
            recent.popitem(last=False)
        return any(other != tenant for other in reversed(recent))  # at most two looked at

    def _start(self, tier: str, waited_s: float, tenant: str, tokens: int, slots: int = 1) -> Ticket:
        self._inflight += slots
        self._tenant_inflight[(tier, tenant)] += slots
        recent = self._recent[tier]
        recent[tenant] = self._clock()
        recent.move_to_end(tenant)
        self.metrics.inflight.set(self._inflight)
        self.metrics.wait.labels(tier).observe(waited_s)
        self.fair_share.charge(tier, tenant, tokens)
        hold_id = next(self._seq)
        self.holds.start(hold_id, self._clock(), slots)
        return Ticket(self, tier, tenant, tokens, slots, hold_id)

    def _next(self) -> _Waiter | None:
        """The waiter to admit next: the best priority level with waiters, then the least-served
        tenant of that level, then that tenant's oldest request."""
        while self._queues:
            priority = min(self._queues)
            level = self._queues[priority]
            if not level:
                del self._queues[priority]
                continue
            key = self.fair_share.pick(level)
            return level[key][0]
        return None

    def _idle_tenant_waiter(self, w: _Waiter) -> _Waiter | None:
        """Another waiter of `w`'s level whose tenant has nothing in flight (it may use the headroom)."""
        for key, waiters in self._queues.get(w.tier.priority, {}).items():
            if waiters and not self._tenant_inflight.get(key):
                return waiters[0]
        return None

    def _dispatch(self) -> None:
        capacity = self._capacity_now()
        while (w := self._next()) is not None:
            # Caps only grow with priority, so when the best waiter cannot start, none can; the one
            # exception is the tenant headroom, which another tenant of the same level may use.
            if not self._fits(w.rank, capacity, w.tier.name, w.tenant, w.slots):
                other = self._idle_tenant_waiter(w)
                if other is None or not self._fits(other.rank, capacity, other.tier.name, other.tenant, other.slots):
                    break
                w = other
            self._take_out(w)
            if w.future.done():  # cancelled (its client left): its task has not run yet to leave the queue
                self.fair_share.leave(w.tier.name, w.tenant)  # what that task's handler would have done
                continue
            w.future.set_result(self._start(w.tier.name, self._clock() - w.enqueued, w.tenant, w.tokens,
                                            self._held(w.rank, capacity, w.slots)))

    def _release(self, ticket: Ticket, used_tokens: int | None) -> None:
        self._inflight -= ticket.slots
        self.holds.end(ticket.hold_id, self._clock())
        key = (ticket.tier, ticket.tenant)
        self._tenant_inflight[key] -= ticket.slots
        if not self._tenant_inflight[key]:
            del self._tenant_inflight[key]
        self.metrics.inflight.set(self._inflight)
        if used_tokens is not None:
            self.fair_share.charge(ticket.tier, ticket.tenant, used_tokens - ticket.charged)
        self.fair_share.leave(ticket.tier, ticket.tenant)
        self._dispatch()

    def _take_out(self, w: _Waiter) -> None:
        """Out of the queue (admitted, shed or cancelled)."""
        w.gone = True
        self._set_depth(w.tier.name, -1)
        level = self._queues.get(w.tier.priority, {})
        waiters = level.get(w.key)
        if waiters is not None:
            try:
                waiters.remove(w)
            except ValueError:
                pass
            if not waiters:
                del level[w.key]

    def _remove(self, w: _Waiter) -> None:
        self._take_out(w)

    def _shed(self, w: _Waiter, reason: str, message: str) -> None:
        self._remove(w)
        self.fair_share.leave(w.tier.name, w.tenant)
        if w.future.done():  # cancelled, its task not run yet: it is gone already, nothing to tell or count
            return
        w.shed_reason = reason
        self.metrics.shed.labels(w.tier.name, reason).inc()
        log.debug("admission shed a %s request (%s) after %.2fs", w.tier.name, reason,
                  self._clock() - w.enqueued)
        w.future.set_exception(Overloaded(message, retry_after=self.retry_after_s(w)))

    def retry_after_s(self, w: _Waiter) -> float:
        """When a slot for shed `w` is likely free: the slots that must free before a retry of it starts (those
        in flight past its tier's cap, plus those of the waiters of its priority or better that go first)."""
        capacity = self._capacity()
        if capacity is None:
            return self.config.retry_after_min_s
        cap = self.cap(w.rank, capacity)
        ahead = sum(min(x.slots, cap) for priority, level in self._queues.items() if priority <= w.tier.priority
                    for waiters in level.values() for x in waiters)
        return self.holds.wait_s(self._inflight + ahead + min(w.slots, cap) - cap, self._clock())

    def _expire(self, w: _Waiter) -> None:
        if not w.gone:
            waited = self._clock() - w.enqueued
            self._shed(w, "deadline", f"the service is at capacity and this {w.tier.name}-tier request "
                                      f"waited {waited:.1f}s without a slot; please retry shortly")

    def _shed_one(self) -> None:
        """queue_full: of the tier shed first, the newest waiter of the tenant with the most service
        once its queue is served (its counter plus the tokens it has waiting) goes."""
        queues = [q for level in self._queues.values() for q in level.values() if q]
        first = min(q[0].tier.shed_order for q in queues)
        candidates = [q for q in queues if q[0].tier.shed_order == first]
        victim = max(candidates, key=lambda q: (self.fair_share.counter(*q[0].key) + sum(w.tokens for w in q),
                                                q[-1].seq))[-1]
        self._shed(victim, "queue_full", f"the service is at capacity and its queue is full; "
                                         f"{victim.tier.name}-tier requests are shed first; please retry "
                                         "shortly")

    def _set_depth(self, tier: str, delta: int) -> None:
        self._depth[tier] += delta
        self.metrics.queue_depth.labels(tier).set(self._depth[tier])
