"""The autoscaler: target tracking on waiting requests per shard, queue time and TTFT beyond prefill.

    policy = TargetTracking(PolicyConfig(min_replicas=1, max_replicas=4, ttft_slo_s=2.0))
    proposal = policy.decide(signals, current=2, now=time.monotonic())    # pure rule + its memory

    scaler = Autoscaler(policy, source, actuator, metrics=AutoscalerMetrics(registry), interval_s=5)
    await scaler.start()         # named task "autoscaler": read signals, decide, act, record
    scaler.decisions()           # the bounded decision log, oldest first (GET /admin/v1/decisions)
    await scaler.aclose()        # stops the task, then the actuator (local shards are stopped)

The rule (:meth:`TargetTracking.decide`), in order:

1. bounds first: fewer than ``min_replicas`` → scale up to it; more than ``max_replicas`` →
   down to it. These need no metrics.
2. never on incomplete signals: ``hold`` with ``missing: ...``.
3. recommend a replica count:

   - *up* when waiting per shard > target x (1 + ``tolerance``): enough shards that the queue
     spread over them is back at the target, given each shard's batch slots:
     ``ceil(load / (slots + target))`` with load = running + waiting over the fleet;
   - *up* when the queue time p95 (admission wait + shard queue) > ``target_queue_time_s`` x (1 +
     ``tolerance``), or TTFT *beyond prefill* p95 > SLO x (1 + ``tolerance``): enough shards for the
     load without a queue, ``max(current + 1, ceil(load / slots))`` — but only under pressure (a
     queue now, or batches >= 75 % full) and once a whole window has passed since the fleet
     settled (every shard asked for serving), so the p95 is about the current fleet. Raw TTFT
     never scales: it grows with the prompt (one long conversation is not load);
   - *down* only when every shard asked for is serving and all are well inside the band: waiting
     per shard <= target x (1 - tolerance), queue time p95 <= its target x ``scale_down_below``,
     TTFT beyond prefill <= SLO x ``scale_down_below`` (None: nothing in the window counts as
     low), and the load would fill at most ``scale_down_below`` of the remaining shards' slots:
     ``ceil(load / (slots x scale_down_below))``. Between the up and down thresholds nothing
     moves (hysteresis).
4. fast up: at most ``max(max_scale_up_step, current)`` more at once, after
   ``scale_up_cooldown_s`` since the last scaling.
5. slow down: one shard at a time (``max_scale_down_step``), after ``scale_down_cooldown_s``
   since the last scaling (and since start), to the *highest* recommendation seen over that
   window, so a dip has to last the whole window.

Every tick is one decision ``{id, at, action, from, to, reason, inputs, outcome}``, where action is
``scale_up | scale_down | hold | steady | error``. Consecutive decisions with the same action, code
and replica counts are folded into one entry (``repeats``, ``last_at``) so a quiet hour stays one
line. Each decision also goes to the ``switchboard_autoscaler_decisions_total{service,action}``
counter, a span ``autoscaler.tick`` with an ``autoscaler.decision`` event, and a log line (INFO when
it differs from the previous one).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from control_plane.scaling.actuators import Actuator, ActuatorError, build_actuator
from control_plane.signals.model import Signals, SignalSource
from data_plane.common.tasks import stop_tasks

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

ACTIONS = ("scale_up", "scale_down", "hold", "steady", "error")


SHEDDING_HOLD_PER_S = 0.2
"""Deliberate sheds per second above which the autoscaler never scales in."""


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of :class:`TargetTracking`; validated on construction."""

    min_replicas: int = 1
    """Never fewer shards than this (0 allows scaling to zero)."""
    max_replicas: int = 4
    """Never more shards than this."""
    target_waiting_per_shard: float = 2.0
    """Requests waiting for a batch slot per shard that the fleet is sized for."""
    ttft_slo_s: float = 2.0
    """Time-to-first-token p95 objective, seconds, held against TTFT beyond prefill."""
    target_queue_time_s: float = 1.0
    """Queue time p95 (admission wait + shard queue), seconds, that the fleet is sized for."""
    busy_batch_usage: float = 0.75
    """Batch usage (running / slots) from which the fleet is under pressure without a queue."""
    scale_up_cooldown_s: float = 15.0
    """Seconds after any scaling before scaling up again (fast up)."""
    scale_down_cooldown_s: float = 120.0
    """Seconds after any scaling (and after start) before scaling down; also the window whose
    highest recommendation a scale-down goes to (slow down)."""
    tolerance: float = 0.1
    """Relative band around the targets inside which nothing scales up."""
    scale_down_below: float = 0.6
    """Scale down only when the load would fill at most this share of the remaining shards' slots
    and TTFT p95 is under this share of the SLO."""
    max_scale_up_step: int = 4
    """Shards added at once: at most max(this, current) (i.e. at least doubling is allowed)."""
    max_scale_down_step: int = 1
    """Shards removed at once."""

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.min_replicas <= self.max_replicas, "need 0 <= min_replicas <= max_replicas"),
            (1 <= self.max_replicas <= 1000, "max_replicas must be in 1..1000"),
            (0 < self.target_waiting_per_shard <= 10_000, "target_waiting_per_shard must be in (0, 10000]"),
            (0 < self.ttft_slo_s <= 3600, "ttft_slo_s must be in (0, 3600]"),
            (0 < self.target_queue_time_s <= 600, "target_queue_time_s must be in (0, 600]"),
            (0 < self.busy_batch_usage <= 1, "busy_batch_usage must be in (0, 1]"),
            (self.scale_up_cooldown_s >= 0 and self.scale_down_cooldown_s >= 0, "cooldowns must be >= 0"),
            (0 <= self.tolerance < 1, "tolerance must be in [0, 1)"),
            (0 < self.scale_down_below < 1, "scale_down_below must be in (0, 1)"),
            (self.max_scale_up_step >= 1 and self.max_scale_down_step >= 1, "steps must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Proposal:
    """What the rule wants this tick."""

    action: str
    """``scale_up | scale_down | hold | steady``."""
    current: int
    desired: int
    reason: str
    code: str
    """Short machine-readable reason (``waiting``, ``ttft``, ``cooldown_up``, ``missing``, ...)."""


class TargetTracking:
    """The scaling rule (see the module docstring). Time is passed in, so the simulator and
    the tests drive it with their own clock; it remembers when it last proposed a scaling
    and its recent recommendations, and assumes every proposal it makes is carried out."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._started_at: float | None = None
        self._last_scale_at = -math.inf
        self._settled_at: float | None = None
        self._recs: collections.deque[tuple[float, int]] = collections.deque()

    def decide(self, signals: Signals, current: int, now: float) -> Proposal:
        cfg = self.config
        if self._started_at is None:
            self._started_at = now
        if current < cfg.min_replicas:
            return self._scaled(
                now,
                "scale_up",
                current,
                cfg.min_replicas,
                "bounds",
                f"below min_replicas ({current} < {cfg.min_replicas})",
            )
        if current > cfg.max_replicas:
            return self._scaled(
                now,
                "scale_down",
                current,
                cfg.max_replicas,
                "bounds",
                f"above max_replicas ({current} > {cfg.max_replicas})",
            )
        if not signals.complete:
            return Proposal("hold", current, current, "missing: " + "; ".join(signals.missing), "missing")
        want, why, code = self._recommend(signals, current, now)
        self._recs.append((now, want))
        while self._recs and self._recs[0][0] < now - cfg.scale_down_cooldown_s:
            self._recs.popleft()
        if want > current:
            return self._up(now, current, want, why, code)
        if want < current:
            return self._down(now, current, why)
        return Proposal("steady", current, current, why, code)

    def _up(self, now: float, current: int, want: int, why: str, code: str) -> Proposal:
        cfg = self.config
        target = min(want, current + max(cfg.max_scale_up_step, current), cfg.max_replicas)
        if target <= current:
            return Proposal(
                "hold", current, current, f"{why}; at max_replicas ({cfg.max_replicas})", "at_max"
            )
        left = cfg.scale_up_cooldown_s - (now - self._last_scale_at)
        if left > 0:
            return Proposal(
                "hold", current, current, f"{why}; scale-up cooldown, {math.ceil(left)}s left", "cooldown_up"
            )
        return self._scaled(now, "scale_up", current, target, code, why)

    def _down(self, now: float, current: int, why: str) -> Proposal:
        cfg = self.config
        assert self._started_at is not None
        left = cfg.scale_down_cooldown_s - (now - max(self._last_scale_at, self._started_at))
        if left > 0:
            return Proposal(
                "hold",
                current,
                current,
                f"{why}; scale-down cooldown, {math.ceil(left)}s left",
                "cooldown_down",
            )
        stable = max(w for _, w in self._recs)  # the highest recommendation over the down window
        target = max(stable, current - cfg.max_scale_down_step, cfg.min_replicas)
        if target >= current:
            return Proposal(
                "hold",
                current,
                current,
                f"{why}; not low for the whole {cfg.scale_down_cooldown_s:.0f}s window yet",
                "stabilizing",
            )
        return self._scaled(now, "scale_down", current, target, "low_load", why)

    def _scaled(self, now: float, action: str, current: int, target: int, code: str, why: str) -> Proposal:
        self._last_scale_at = now
        if action == "scale_up":
            self._settled_at = None
        self._recs.clear()  # recommendations made for the old fleet size say nothing about the new
        return Proposal(action, current, target, why, code)

    def _recommend(self, s: Signals, current: int, now: float) -> tuple[int, str, str]:
        """(replicas wanted, why, code) from the signals, before cooldowns and steps."""
        cfg = self.config
        wps = s.waiting_per_shard if s.waiting_per_shard is not None else 0.0
        n = max(s.healthy_shards, 1)
        slots = s.capacity_per_shard if s.capacity_per_shard and math.isfinite(s.capacity_per_shard) else None
        load = (s.load_per_shard or 0.0) * n
        target = cfg.target_waiting_per_shard
        slo, queue_target = cfg.ttft_slo_s, cfg.target_queue_time_s
        queue, excess = s.queue_time_p95_s, s.ttft_excess_p95_s
        figures = (
            f"waiting/shard {wps:.1f} (target {target:g}), queue p95 {_secs(queue)} (target {queue_target:g}s), "
            f"TTFT beyond prefill p95 {_secs(excess)} (SLO {slo:g}s; raw TTFT p95 {_secs(s.ttft_p95_s)}), "
            f"batches {_pct(s.batch_usage)} full, load {load:.0f}"
            f"{'' if slots is None else f' on {n}x{slots:.0f} slots'}"
        )
        wants: list[tuple[int, str, str]] = []
        starting = s.healthy_shards < current  # asked-for shards not serving yet: their capacity is coming
        if wps > target * (1 + cfg.tolerance):
            want = math.ceil(load / (slots + target)) if slots else math.ceil(current * wps / target)
            wants.append((want if starting else max(want, current + 1), "waiting above target", "waiting"))
        # p95s lag by their window: only a window that started after the fleet last settled
        # (every asked-for shard serving) says anything about the current fleet
        if starting:
            self._settled_at = None
        elif self._settled_at is None:
            self._settled_at = now
        fresh = self._settled_at is not None and now - self._settled_at >= s.window_s
        pressure = wps > 0 or (s.batch_usage or 0.0) >= cfg.busy_batch_usage
        sized = max(current + 1, math.ceil(load / slots) if slots else current + 1)
        if fresh and pressure and queue is not None and queue > queue_target * (1 + cfg.tolerance):
            wants.append((sized, "queue time p95 above target", "queue_time"))
        if fresh and pressure and excess is not None and excess > slo * (1 + cfg.tolerance):
            wants.append((sized, "TTFT beyond prefill above SLO", "ttft_excess"))
        if wants:
            want, why, code = max(wants)
            return want, f"{why}: {figures}", code
        calm_latency = ((queue is None or queue <= queue_target * cfg.scale_down_below)
                        and (excess is None or excess <= slo * cfg.scale_down_below))
        if s.shed_per_s > SHEDDING_HOLD_PER_S:
            # Demand is being turned away (degradation or admission): admitted load is low
            # because of the shedding, not because the fleet is too big.
            return current, f"within band: shedding {s.shed_per_s:.1f} req/s; {figures}", "steady"
        if wps <= target * (1 - cfg.tolerance) and calm_latency and not starting:
            fits = math.ceil(load / (slots * cfg.scale_down_below)) if slots else current - (wps == 0)
            want = max(fits, cfg.min_replicas)
            if want < current:
                return want, f"low load: {figures}", "low_load"
        return current, f"within band: {figures}", "steady"


def _secs(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


class AutoscalerMetrics:
    """The autoscaler's series; every one carries ``service`` (``shard``), as the alert rules assume.

    metrics = AutoscalerMetrics(CollectorRegistry())
    """

    def __init__(self, registry: CollectorRegistry, service: str = "shard") -> None:
        self.service = service
        self.decisions = Counter(
            "switchboard_autoscaler_decisions",
            "Autoscaler decisions by action.",
            ["service", "action"],
            registry=registry,
        )
        self.desired = Gauge(
            "switchboard_autoscaler_desired_replicas",
            "Replicas the autoscaler wants.",
            ["service"],
            registry=registry,
        )
        self.actual = Gauge(
            "switchboard_autoscaler_actual_replicas",
            "Replicas the actuator reports running.",
            ["service"],
            registry=registry,
        )
        self.min = Gauge(
            "switchboard_autoscaler_min_replicas", "The configured floor.", ["service"], registry=registry
        )
        self.max = Gauge(
            "switchboard_autoscaler_max_replicas", "The configured ceiling.", ["service"], registry=registry
        )
        for action in ACTIONS:
            self.decisions.labels(service, action)

    def bounds(self, config: PolicyConfig) -> None:
        self.min.labels(self.service).set(config.min_replicas)
        self.max.labels(self.service).set(config.max_replicas)

    def record(self, action: str, desired: int | None, actual: int | None) -> None:
        self.decisions.labels(self.service, action).inc()
        if desired is not None:
            self.desired.labels(self.service).set(desired)
        if actual is not None:
            self.actual.labels(self.service).set(actual)


@dataclass
class _Entry:
    id: int
    at: float
    action: str
    code: str
    current: int | None
    desired: int | None
    reason: str
    inputs: dict[str, Any]
    outcome: str
    repeats: int = 1
    last_at: float = field(default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at,
            "last_at": self.last_at or self.at,
            "repeats": self.repeats,
            "action": self.action,
            "code": self.code,
            "from": self.current,
            "to": self.desired,
            "reason": self.reason,
            "outcome": self.outcome,
            "inputs": self.inputs,
        }


class Autoscaler:
    """Runs :class:`TargetTracking` every `interval_s` on `source`, through `actuator`.

    `tick` is one round (the task calls it; tests call it directly). A failing signal source or
    actuator is an ``error`` decision, never an exception out of the task.
    """

    def __init__(
        self,
        policy: TargetTracking,
        source: SignalSource | None = None,
        actuator: Actuator | None = None,
        *,
        metrics: AutoscalerMetrics | None = None,
        interval_s: float = 5.0,
        max_decisions: int = 500,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        actuator_factory: Callable[[httpx.AsyncClient], Actuator] | None = None,
    ) -> None:
        self.policy = policy
        self.source = source
        self.actuator = actuator
        self.metrics = metrics
        self.interval_s = interval_s
        self._clock, self._wall = clock, wall
        self._actuator_factory = actuator_factory
        self._log: collections.deque[_Entry] = collections.deque(maxlen=max_decisions)
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        if metrics is not None:
            metrics.bounds(policy.config)

    async def start(self, source: SignalSource | None = None, http: httpx.AsyncClient | None = None) -> None:
        """Start the task; `source` and `http` (for an actuator built from settings) come from the
        process's lifespan, where its one http client and signal source are opened."""
        if source is not None:
            self.source = source
        if self.actuator is None:
            if self._actuator_factory is None or http is None:
                raise ValueError("no actuator: pass one, or an actuator_factory and http to start()")
            self.actuator = self._actuator_factory(http)
        if self.source is None:
            raise ValueError("no signal source")
        self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def aclose(self) -> None:
        """Stop the task, then the actuator (the local one stops the shards it started)."""
        await stop_tasks(self._task)
        self._task = None
        if self.actuator is not None:
            await self.actuator.aclose()

    def decisions(self) -> list[dict[str, Any]]:
        """The decision log, oldest first; each ``{id, at, last_at, repeats, action, code, from, to,
        reason, outcome, inputs}`` (inputs: the aggregate signals plus ``current``)."""
        return [e.to_dict() for e in self._log]

    async def replace_lost(self, zone: str, lost: int) -> dict[str, Any]:
        """A zone lost `lost` shards (control_plane/zones.py): ask the actuator for as many more, up to
        the maximum, at once and whatever the cooldowns; a local actuator starts them in a live zone.
        The usual target tracking scales the surplus back down once the zone returns."""
        assert self.actuator is not None, "start() first"
        with tracer.start_as_current_span("autoscaler.zone_down") as span:
            try:
                current = await self.actuator.current()
            except (ActuatorError, httpx.HTTPError, OSError) as exc:
                entry = self._record("error", "read_failed", None, None, f"cannot read state: {exc}", {}, "error")
                self._emit(span, entry)
                return entry.to_dict()
            desired = min(self.policy.config.max_replicas, current + max(0, lost))
            reason = (f"zone {zone} lost {lost} shard(s): {desired - current} replacement(s) in the surviving zones"
                      + ("" if desired - current == lost else f" (capped by max_replicas {desired})"))
            outcome = "-"
            if desired > current:
                try:
                    await self.actuator.scale_to(desired, reason)
                    outcome = "ok"
                except ActuatorError as exc:
                    outcome = f"error: {exc}"
            entry = self._record("scale_up" if desired > current else "hold", "zone_down", current, desired, reason,
                                 {"current": current, "zone": zone, "lost": lost}, outcome)
            self._emit(span, entry)
            return entry.to_dict()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bug in one tick must not stop autoscaling
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> dict[str, Any]:
        assert self.source is not None and self.actuator is not None, "start() first, or pass both"
        with tracer.start_as_current_span("autoscaler.tick") as span:
            try:
                signals = await self.source.read()
                current = await self.actuator.current()
            except (ActuatorError, httpx.HTTPError, OSError) as exc:
                entry = self._record(
                    "error", "read_failed", None, None, f"cannot read state: {exc}", {}, "error"
                )
                self._emit(span, entry)
                return entry.to_dict()
            proposal = self.policy.decide(signals, current, self._clock())
            inputs = {**signals.summary(), "current": current}
            outcome = "-"
            if proposal.desired != current:
                try:
                    await self.actuator.scale_to(proposal.desired, proposal.reason)
                    outcome = "ok"
                except ActuatorError as exc:
                    outcome = f"error: {exc}"
            entry = self._record(
                proposal.action, proposal.code, current, proposal.desired, proposal.reason, inputs, outcome
            )
            self._emit(span, entry)
            return entry.to_dict()

    def _record(
        self,
        action: str,
        code: str,
        current: int | None,
        desired: int | None,
        reason: str,
        inputs: dict[str, Any],
        outcome: str,
    ) -> _Entry:
        now = self._wall()
        last = self._log[-1] if self._log else None
        if (
            last is not None
            and action in ("hold", "steady")
            and (last.action, last.code, last.current, last.desired) == (action, code, current, desired)
        ):
            last.repeats += 1
            last.last_at, last.reason, last.inputs = now, reason, inputs
            entry, fresh = last, False
        else:
            entry = _Entry(
                next(self._ids), now, action, code, current, desired, reason, inputs, outcome, last_at=now
            )
            self._log.append(entry)
            fresh = True
        if self.metrics is not None:
            self.metrics.record(action, desired, current)
        level = logging.INFO if fresh else logging.DEBUG
        log.log(level, "autoscaler %s %s->%s: %s [%s]", action, current, desired, reason, outcome)
        return entry

    @staticmethod
    def _emit(span: trace.Span, entry: _Entry) -> None:
        span.set_attribute("switchboard.autoscaler.action", entry.action)
        attributes: dict[str, Any] = {
            "action": entry.action,
            "code": entry.code,
            "reason": entry.reason,
            "outcome": entry.outcome,
        }
        if entry.current is not None and entry.desired is not None:
            attributes.update({"from": entry.current, "to": entry.desired})
        for key in ("waiting_per_shard", "queue_time_p95_s", "ttft_excess_p95_s", "ttft_p95_s", "batch_usage",
                    "healthy_shards", "load_per_shard"):
            value = entry.inputs.get(key)
            if isinstance(value, (int, float)):
                attributes[f"signals.{key}"] = value
        span.add_event("autoscaler.decision", attributes)


def policy_config(settings: Any) -> PolicyConfig:
    """A :class:`PolicyConfig` from :class:`~control_plane.settings.ControlPlaneSettings`."""
    return PolicyConfig(
        min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas,
        target_waiting_per_shard=settings.target_waiting_per_shard,
        ttft_slo_s=settings.ttft_slo_s,
        target_queue_time_s=settings.target_queue_time_s,
        scale_up_cooldown_s=settings.scale_up_cooldown_s,
        scale_down_cooldown_s=settings.scale_down_cooldown_s,
    )


def build_autoscaler(settings: Any, metrics_registry: CollectorRegistry) -> Autoscaler | None:
    """The autoscaler the settings ask for (None without ``--autoscale``); its actuator is built
    from the settings in ``start(source, http)``.

        autoscaler = build_autoscaler(settings, metrics_registry)     # in create_app
        await autoscaler.start(signal_source, http)                   # in the lifespan
    """
    if not settings.autoscale:
        return None
    return Autoscaler(
        TargetTracking(policy_config(settings)),
        metrics=AutoscalerMetrics(metrics_registry),
        interval_s=settings.autoscale_interval_s,
        actuator_factory=lambda http: build_actuator(settings, http),
    )


__all__ = [
    "ACTIONS",
    "Autoscaler",
    "AutoscalerMetrics",
    "PolicyConfig",
    "Proposal",
    "TargetTracking",
    "add_autoscaler_flags",
    "build_autoscaler",
    "policy_config",
]


def add_autoscaler_flags(parser: argparse.ArgumentParser) -> None:
    """The signals/autoscaler/actuator flags of ``switchboard control-plane`` (fields of
    :class:`~control_plane.settings.ControlPlaneSettings`; each also reads its env variable)."""
    g = parser.add_argument_group("signals and autoscaling")
    g.add_argument("--prometheus", metavar="URL", help="read signals from Prometheus instead of scraping")
    g.add_argument("--signals-window", dest="signals_window_s", type=float, help="rate/p95 window, s (30)")
    g.add_argument(
        "--autoscale", action="store_true", default=None, help="run the autoscaler (off by default)"
    )
    g.add_argument(
        "--actuator", choices=("local", "nomad", "kubernetes"), help="how to scale (default local)"
    )
    g.add_argument("--min-replicas", type=int, help="fewest shards (default 1)")
    g.add_argument("--max-replicas", type=int, help="most shards (default 4)")
    g.add_argument("--target-waiting-per-shard", type=float, help="queue per shard to size for (default 2)")
    g.add_argument("--ttft-slo-s", type=float, help="TTFT p95 objective, s (default 2), held against TTFT beyond prefill")
    g.add_argument("--target-queue-time-s", type=float, help="queue time p95 to size for, s (default 1)")
    g.add_argument("--scale-up-cooldown-s", type=float, help="s after a scaling before scaling up (15)")
    g.add_argument("--scale-down-cooldown-s", type=float, help="s after a scaling before scaling down (120)")
    g.add_argument("--autoscale-interval-s", type=float, help="s between decisions (default 5)")
    g.add_argument(
        "--shard-args", help='local actuator: flags for the shards it starts, e.g. "--engine synthetic"'
    )
    g.add_argument("--shard-log-dir", help="local actuator: shard logs (default .switchboard/logs)")
    g.add_argument("--drain-timeout-s", type=float, help="local actuator: longest drain before SIGTERM (30)")
    g.add_argument("--nomad-addr", help="nomad actuator: API address (or NOMAD_ADDR)")
    g.add_argument("--nomad-job", help="nomad actuator: job id (default switchboard)")
    g.add_argument("--nomad-group", help="nomad actuator: shards' task group (default shard)")
    g.add_argument("--nomad-namespace", help="nomad actuator: namespace")
    g.add_argument("--nomad-region", help="nomad actuator: region")
    g.add_argument(
        "--kubeconfig", help="kubernetes actuator: kubeconfig (default in-cluster, then $KUBECONFIG)"
    )
    g.add_argument("--kube-namespace", help="kubernetes actuator: namespace")
    g.add_argument("--kube-deployment", help="kubernetes actuator: shards' Deployment (switchboard-shard)")
