"""Fair share between the tenants of a tier: a virtual token counter (VTC), as in Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI 2024).

Owned by the gateway's admission queue (data_plane/gateway/admission.py), which asks it which
tenant's request goes next within a tier.

    share = FairShare(AdmissionMetrics(registry).tenant_service, top_n=20)
    share.arrive("free", "acme", priority=2)        # a tenant's request joins the queue (lift, see below)
    share.charge("free", "acme", 300)               # tokens served: prompt + output (estimate at admission,
    share.charge("free", "acme", -40)               #   settled to the real usage at release)
    share.counter("free", "acme")                   # its virtual counter
    share.pick([("free", "globex"), ("free", "acme")])   # whose waiter goes first: the least served

Each tenant of a tier has a counter of the tokens served to it (prompt + output). The admission
queue serves, among waiters of one priority level, the tenant with the lowest counter first, so a
tenant sending many requests cannot starve the others: it is served as much as each of them, not
in proportion to what it sends. Tier order stays above this (admission picks the priority level
first).

Lift: a tenant that was idle has a low counter, and would take every slot until it caught up. So a
tenant that arrives with nothing queued or in flight is lifted to the lowest counter among the
tenants of its level that are active (queued or in flight), or, when none is, to the counter of the
tenant served last at that level (the paper's rule). Counters live per gateway and in memory; at
most ``max_tenants`` are kept (the least recently active go first: forgetting one is the same as
lifting it when it returns).

Metric (bounded): ``switchboard_admission_tenant_service_tokens{tier, tenant}``, the tokens served
since start to the ``top_n`` tenants of each tier with the most service, the rest summed as
``tenant="other"``; refreshed at most once per ``publish_interval_s`` while charges come in, and on
every scrape (:meth:`FairShare.flush`, called by the gateway's ``/metrics``), so the last charges of a
burst are never held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Gauge

OTHER = "other"
"""The tenant label that sums every tenant outside the top N."""


@dataclass
class _Tenant:
    counter: float = 0.0
    """Virtual tokens: service received, lifted when (re)arriving."""
    served: float = 0.0
    """Tokens served since start (for the metric; never lifted)."""
    active: int = 0
    """Requests queued or in flight."""
    priority: int = 0
    last_seen: float = 0.0


class FairShare:
    """The counters (see the module docstring). Not thread-safe: the admission loop owns it."""

    def __init__(self, gauge: Gauge | None = None, *, top_n: int = 20, max_tenants: int = 10_000,
                 publish_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if top_n < 1 or max_tenants < 1:
            raise ValueError("fair share: top_n and max_tenants must be >= 1")
        self._gauge = gauge
        """``switchboard_admission_tenant_service_tokens{tier, tenant}`` (data_plane/gateway/admission.py)."""
        self._top_n = top_n
        self._max_tenants = max_tenants
        self._publish_interval_s = publish_interval_s
        self._clock = clock
        self._tenants: dict[tuple[str, str], _Tenant] = {}
        self._last_served: dict[int, float] = {}
        """Priority level -> counter of the tenant charged last there."""
        self._published: set[tuple[str, str]] = set()
        self._published_at = -float("inf")
        self._dirty = False
        """A charge the throttle has not published yet."""

    def counter(self, tier: str, tenant: str) -> float:
        t = self._tenants.get((tier, tenant))
        return t.counter if t is not None else 0.0

    def arrive(self, tier: str, tenant: str, priority: int) -> None:
        """A request of `tenant` is queued or admitted: lift an idle tenant, count it active."""
        key = (tier, tenant)
        t = self._tenants.get(key)
        if t is None:
            self._forget_if_full()
            t = self._tenants[key] = _Tenant(priority=priority)
        if t.active == 0:
            active = [o.counter for k, o in self._tenants.items()
                      if o.active > 0 and o.priority == priority and k != key]
            floor = min(active) if active else self._last_served.get(priority, 0.0)
            t.counter = max(t.counter, floor)
        t.priority = priority
        t.active += 1
        t.last_seen = self._clock()

    def leave(self, tier: str, tenant: str) -> None:
        """One of `tenant`'s requests left (finished, shed or cancelled)."""
        t = self._tenants.get((tier, tenant))
        if t is not None and t.active > 0:
            t.active -= 1
            t.last_seen = self._clock()

    def charge(self, tier: str, tenant: str, tokens: float) -> None:
        """Count `tokens` of service (negative: a refund of an estimate that was too high)."""
        t = self._tenants.get((tier, tenant))
        if t is None:
            return
        t.counter = max(0.0, t.counter + tokens)
        t.served = max(0.0, t.served + tokens)
        self._last_served[t.priority] = t.counter
        self._publish()

    def flush(self) -> None:
        """Publish what the throttle held back (a scrape calls it: the gauge then shows every charge)."""
        if self._dirty:
            self._publish(force=True)

    def pick(self, keys: Iterable[tuple[str, str]]) -> tuple[str, str]:
        """The ``(tier, tenant)`` of `keys` with the least service (the first of equals)."""
        return min(keys, key=lambda key: self.counter(*key))

    # -- internals ---------------------------------------------------------------------------

    def _forget_if_full(self) -> None:
        if len(self._tenants) < self._max_tenants:
            return
        idle = sorted((t.last_seen, k) for k, t in self._tenants.items() if t.active == 0)
        for _, key in idle[: max(1, len(idle) // 10)]:
            del self._tenants[key]

    def _publish(self, *, force: bool = False) -> None:
        if self._gauge is None:
            return
        now = self._clock()
        if not force and now - self._published_at < self._publish_interval_s:
            self._dirty = True
            return
        self._published_at = now
        self._dirty = False
        by_tier: dict[str, list[tuple[float, str]]] = {}
        for (tier, tenant), t in self._tenants.items():
            by_tier.setdefault(tier, []).append((t.served, tenant))
        shown: set[tuple[str, str]] = set()
        gauge = self._gauge
        for tier, rows in by_tier.items():
            rows.sort(reverse=True)
            top = [r for r in rows if r[1] != OTHER][: self._top_n]
            for served, tenant in top:
                gauge.labels(tier, tenant).set(served)
                shown.add((tier, tenant))
            rest = sum(served for served, tenant in rows) - sum(served for served, _ in top)
            gauge.labels(tier, OTHER).set(rest)
            shown.add((tier, OTHER))
        for labels in self._published - shown:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        self._published = shown
