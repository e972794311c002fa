"""The autoscaler's control loop: each tick reads the signals, asks the policy, calls the actuator, records.

    scaler = Autoscaler(policy, source, actuator, metrics=AutoscalerMetrics(registry), interval_s=5)
    await scaler.start()         # named task "autoscaler": read signals, decide, act, record
    scaler.decisions()           # the bounded decision log, oldest first (GET /admin/v1/decisions)
    await scaler.aclose()        # stops the task, then the actuator (local shards are stopped)

Built by :func:`build_autoscaler` in control_plane/app.py (``--autoscale``), started in its lifespan;
control_plane/zones.py calls ``replace_lost`` when a zone goes down. The rule it runs is
:class:`~control_plane.scaling.policy.TargetTracking` (control_plane/scaling/policy.py); the
actuators (control_plane/scaling/actuators/) carry out what it decides.

Every tick is one decision ``{id, at, action, from, to, reason, inputs, outcome}``, where action is
``scale_up | scale_down | hold | steady | error``. Consecutive decisions with the same action, code
and replica counts are folded into one entry (``repeats``, ``last_at``) so a quiet hour stays one
line. Each decision also goes to the ``switchboard_autoscaler_decisions_total{service,action}``
counter, a span ``autoscaler.tick`` with an ``autoscaler.decision`` event, and a log line (INFO when
it differs from the previous one).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from control_plane.scaling.actuators import Actuator, ActuatorCapped, ActuatorError, build_actuator
from control_plane.scaling.policy import PolicyConfig, TargetTracking, policy_config
from control_plane.signals.model import SignalSource
from data_plane.common.tasks import stop_tasks

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

ACTIONS = ("scale_up", "scale_down", "hold", "steady", "error")


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
                except ActuatorCapped as exc:
                    outcome = f"capped: {exc}"
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
            and (action in ("hold", "steady") or outcome.startswith("capped"))
            and (last.action, last.code, last.current, last.desired, last.outcome)
            == (action, code, current, desired, outcome)
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


def build_autoscaler(settings: ControlPlaneSettings, metrics_registry: CollectorRegistry) -> Autoscaler | None:
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
    "build_autoscaler",
]

