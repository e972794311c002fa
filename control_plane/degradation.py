"""The degradation ladder: how much the platform gives up, raised and lowered from the signals.

    controller = DegradationController(store, source, config=LadderConfig(ttft_slo_s=2.0),
                                       metrics=DegradationMetrics(registry))
    await controller.start()          # named task: read signals every interval_s, maybe step
    controller.pin(Level.SHED_FREE_TIER, "incident 42")  # operator: hold level 3 (persisted)
    controller.release("fixed")       # back to automatic, from the level in force
    controller.snapshot()             # {"level", "pinned", "reason", "since", "history", ...}
    await controller.aclose()

The levels (:class:`data_plane.common.ladder.Level`; enforced by the gateway,
``data_plane/gateway/cluster_state.py``)::

    0 normal            1 shrink context window      2 cap output tokens
    3 shed free tier    4 enterprise only

The automatic rule (control_plane/degradation_rule.py), evaluated on every read of the signals,
reads only what means overload: a queue (waiting per shard, queue time), TTFT *beyond* prefill, and
busy batches / KV. Raw TTFT grows with the prompt and never moves the ladder; without a queue and
with the batches not busy, nothing raises it.

- *hot*: one overload figure above its raise threshold. Raises one level once the current level
  has been held ``raise_dwell_s`` (fast up); when only windowed figures (queue time p95, TTFT
  beyond prefill, error rate) are hot, also at least one signals window, since until then the
  window still shows the load the current level sheds (no overshoot to 4 on a stale p95).
- *calm*: every figure below its (lower) threshold. Lowers one level once calm has lasted the
  dwell *of the cause that raised the level* without a break, and the level has been held as long:
  ``lower_dwell_gauge_s`` (10 s) for a queue or KV gauge and for an operator's pin,
  ``lower_dwell_s`` (30 s, one signals window) for a windowed figure (queue time p95, TTFT beyond
  prefill, error rate) or an unknown cause (after a restart).
- between the two thresholds nothing moves (hysteresis); signals that are incomplete (a shard not
  scraped, a stale metric, a figure a complete reading must carry) never move the ladder, and they
  break a calm streak.

While an operator pins a level the rule is still evaluated (and shown) but not applied. Releasing
a pin keeps the level in force and hands it back to the rule; the pinned time counts as time at
the level and calm seen while pinned counts, so with calm signals the ladder steps down at the
next reading, then one step per dwell: dropping straight from 4 to 0 would let back all the load
that was shed at once.

Every change is a :class:`~control_plane.ladder.LevelChange` (``{at, from, to, reason, signals, actor,
pinned}`` on the wire) in a bounded history (persisted with the level by
:class:`~control_plane.policy_store.PolicyStore`), a metric, a span with a
``degradation.level_changed`` event, and a log line.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from control_plane.degradation_rule import Assessment, LadderConfig, assess
from control_plane.ladder import WINDOWED_CAUSES, Actor, Cause, Direction, LevelChange, Outcome, Verdict
from control_plane.policy_store import DegradationRecord, PolicyStore
from control_plane.settings import ControlPlaneSettings
from control_plane.signals.model import Signals
from data_plane.common.ladder import Level
from data_plane.common.tasks import stop_tasks

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

LEVELS: dict[int, str] = {int(level): level.label for level in Level}
"""Level number -> machine name, as the admin API's ``name`` field says it."""


class SignalReader(Protocol):
    """A source of signals; ``read()`` is called once per ``interval_s`` by the controller's task."""

    async def read(self) -> Signals: ...


def signals_dict(signals: Signals | None, *, full: bool = False) -> dict[str, Any]:
    """A JSON-ready dict of a Signals value: its ``summary()`` (no per-shard list) unless `full`."""
    if signals is None:
        return {}
    out: dict[str, Any] = _jsonable(signals.to_dict() if full else signals.summary())
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class DegradationMetrics:
    """Prometheus view of the ladder; alerts and dashboards depend on these exact names.

    metrics = DegradationMetrics(CollectorRegistry())
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.level = Gauge(
            "switchboard_degradation_level",
            "Degradation level in force: 0 normal, 1 shrink context, 2 cap output, 3 shed free, 4 enterprise only.",
            registry=registry,
        )
        self.pinned = Gauge(
            "switchboard_degradation_pinned", "1 while an operator pins the degradation level.", registry=registry
        )
        self.changes = Counter(
            "switchboard_degradation_changes",
            "Degradation ladder events by direction (up|down|none) and actor (auto|operator).",
            ["direction", "actor"],
            registry=registry,
        )
        self.evaluations = Counter(
            "switchboard_degradation_evaluations",
            "Evaluations of the automatic rule by outcome (raise|lower|hold|incomplete|pinned).",
            ["outcome"],
            registry=registry,
        )
        for direction in Direction:
            for actor in Actor:
                self.changes.labels(direction, actor)
        for outcome in Outcome:
            self.evaluations.labels(outcome)


@dataclass
class Clock:
    """The controller's two clocks (tests pass one fake clock for both)."""

    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic



class DegradationController:
    """Owns the ladder: the automatic rule's task, operator pins, events, metrics, persistence.

    `observe` is the rule (synchronous, so tests feed it signals with a fake clock); the task
    started by `start` calls `tick` (read the source, then `observe`) every ``interval_s``.
    `pin` and `release` are called by the admin API. Nothing here raises because the signal
    source fails: a failed read counts as incomplete signals.
    """

    def __init__(
        self,
        store: PolicyStore,
        source: SignalReader | None,
        *,
        config: LadderConfig | None = None,
        metrics: DegradationMetrics | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config or LadderConfig()
        self._store = store
        self._source = source
        self._metrics = metrics
        self._clock = clock or Clock()
        # dwell restarts at (re)start: a restored level that readings do not find calm is held a dwell time
        self._changed_at = self._clock.monotonic()
        self._calm_since: float | None = None
        self._cause: tuple[Cause, ...] = ()
        """What raised the level in force (``operator`` for a pin); () when unknown (restart)."""
        self._last_assessment = Assessment(Verdict.INCOMPLETE, ("no signals read yet",))
        self._signals: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.config.signal_history)
        self._latest: Signals | None = None
        self._read_failing = False
        self._task: asyncio.Task[None] | None = None
        record = store.degradation
        self._restored = record.level if record.level > Level.NORMAL and not record.pinned else None
        """An automatic level restored from the store, not yet confirmed by a reading of this process: held
        while readings are hot or in between (a control plane restarted mid-overload keeps shedding), dropped
        at the first calm one (a fresh start after an overload must not shed an idle fleet for dwell x level)."""
        self._publish_metrics()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, source: SignalReader | None = None) -> None:
        """Start the rule's task; `source` replaces the constructor's (the control plane builds
        its source in the lifespan, with the process's HTTP client)."""
        if source is not None:
            self._source = source
        if self._source is None:
            log.warning("degradation: no signal source; the ladder moves only by operator pins")
            return
        self._task = asyncio.create_task(self._run(), name="degradation-controller")

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        self._task = None

    # -- reads -----------------------------------------------------------------------------

    @property
    def level(self) -> Level:
        return self._store.degradation.level

    @property
    def pinned(self) -> bool:
        return self._store.degradation.pinned

    @property
    def latest_signals(self) -> Signals | None:
        """The last Signals read (None before the first read)."""
        return self._latest

    def signal_history(self) -> list[dict[str, Any]]:
        """Recent readings, oldest first, each ``{"at": unix_s, **signals}``."""
        return list(self._signals)

    def snapshot(self) -> dict[str, Any]:
        record = self._store.degradation
        assessment = self._last_assessment
        return {
            "level": int(record.level),
            "name": record.level.label,
            "pinned": record.pinned,
            "reason": record.reason,
            "since": record.since,
            "automatic": {
                "verdict": assessment.verdict,
                "reasons": list(assessment.reasons),
                "calm_for_s": self._calm_for(),
                "held_for_s": round(self._clock.monotonic() - self._changed_at, 3),
                "raise_dwell_s": self.config.raise_dwell_s,
                "lower_dwell_s": self._lower_dwell(),
                "cause": list(self._cause),
            },
            "history": [e.to_dict() for e in record.history],
        }

    # -- the automatic rule ------------------------------------------------------------------

    async def tick(self) -> LevelChange | None:
        """Read the source once and apply the rule; returns the change event, if any."""
        signals: Signals | None = None
        if self._source is not None:
            try:
                signals = await self._source.read()
            except Exception as exc:  # noqa: BLE001 -- a broken source is missing signals, never a crash
                if not self._read_failing:
                    log.warning("degradation: reading signals failed (%s: %s)", type(exc).__name__, exc)
                self._read_failing = True
            else:
                if self._read_failing:
                    log.info("degradation: signals readable again")
                self._read_failing = False
        return self.observe(signals)

    def observe(self, signals: Signals | None) -> LevelChange | None:
        """Apply the rule to one reading; returns the change event if the level moved."""
        now = self._clock.monotonic()
        if signals is not None:
            self._latest = signals
            self._signals.append({"at": self._clock.wall(), **signals_dict(signals)})
        assessment = assess(signals, self.config)
        self._last_assessment = assessment
        if assessment.verdict is Verdict.CALM:
            if self._calm_since is None:
                self._calm_since = now
        else:
            self._calm_since = None
        record = self._store.degradation
        held = now - self._changed_at
        dwell = self._lower_dwell()
        outcome, target = Outcome.HOLD, record.level
        if assessment.verdict is Verdict.INCOMPLETE:
            outcome = Outcome.INCOMPLETE
        elif record.pinned:
            outcome = Outcome.PINNED
        elif (assessment.verdict is Verdict.HOT and record.level < max(Level)
              and held >= self._raise_dwell(assessment, signals)):
            outcome, target = Outcome.RAISE, Level(record.level + 1)
        elif assessment.verdict is Verdict.CALM and self._restored is not None and record.level == self._restored:
            outcome, target = Outcome.LOWER, Level.NORMAL
        elif (
            assessment.verdict is Verdict.CALM
            and record.level > Level.NORMAL
            and held >= dwell
            and self._calm_for() >= dwell
        ):
            outcome, target = Outcome.LOWER, Level(record.level - 1)
        if assessment.verdict is not Verdict.INCOMPLETE:
            restored, self._restored = self._restored, None
        else:
            restored = None
        if self._metrics is not None:
            self._metrics.evaluations.labels(outcome).inc()
        if target == record.level:
            return None
        if outcome is Outcome.LOWER and restored is not None:
            reason = (f"level {int(restored)} restored at start, calm at the first reading (nothing to shed): "
                      + "; ".join(assessment.reasons))
        elif outcome is Outcome.LOWER:
            reason = f"calm for {self._calm_for():.0f}s: " + "; ".join(assessment.reasons)
        else:
            reason = "; ".join(assessment.reasons)
        event = self._change(target, reason, actor=Actor.AUTO, pinned=False, signals=signals)
        if outcome is Outcome.RAISE:
            self._cause = assessment.causes
        if outcome is Outcome.LOWER:
            self._calm_since = now  # the next step down needs a fresh calm period at the new level
            if target == Level.NORMAL:
                self._cause = ()
        return event

    # -- operator --------------------------------------------------------------------------

    def pin(self, level: int, reason: str) -> LevelChange:
        """Hold `level` until `release`; takes effect at once (no dwell, any distance).
        ValueError for a level outside 0..4."""
        target = Level.parse(level)
        self._cause = (Cause.OPERATOR,)
        self._restored = None
        return self._change(target, f"pinned: {reason}", actor=Actor.OPERATOR, pinned=True, signals=self._latest)

    def release(self, reason: str = "released") -> LevelChange | None:
        """Hand the level back to the automatic rule (from where it stands); None if not pinned.

        The time the pin held the level counts as time at the level, and calm seen while pinned
        counts as calm: with calm signals the rule steps down at its next reading, then one step
        per ``lower_dwell_gauge_s`` (a pin is the operator's cause, not a windowed signal's)."""
        record = self._store.degradation
        if not record.pinned:
            return None
        changed_at = self._changed_at
        event = self._change(record.level, f"released: {reason}", actor=Actor.OPERATOR, pinned=False,
                             signals=self._latest)
        self._changed_at = changed_at
        return event

    # -- internals -------------------------------------------------------------------------

    def _raise_dwell(self, assessment: Assessment, signals: Signals | None) -> float:
        """``raise_dwell_s``; when only windowed figures are hot, at least their window too: until
        the window holds only readings at the current level, they still show the load it sheds."""
        if signals is not None and assessment.causes and set(assessment.causes) <= WINDOWED_CAUSES:
            return max(self.config.raise_dwell_s, signals.window_s)
        return self.config.raise_dwell_s

    def retry_after_s(self) -> float:
        """What the gateways send as Retry-After with a request the ladder sheds: the calm this level needs
        before it can step down (the dwell of the cause that raised it: a gauge's or a pin's is shorter than
        a windowed figure's), not one fixed figure for every cause."""
        return self._lower_dwell()

    def _lower_dwell(self) -> float:
        return self.config.lower_dwell_for(self._cause)

    def _calm_for(self) -> float:
        return 0.0 if self._calm_since is None else round(self._clock.monotonic() - self._calm_since, 3)

    def _change(self, to: Level, reason: str, *, actor: Actor, pinned: bool,
                signals: Signals | None) -> LevelChange:
        record = self._store.degradation
        at = self._clock.wall()
        event = LevelChange(at=at, from_level=record.level, to=to, reason=reason, actor=actor, pinned=pinned,
                            signals=signals_dict(signals))
        history = (*record.history, event)[-self.config.history:]
        self._store.save_degradation(DegradationRecord(level=to, reason=reason, pinned=pinned, since=at,
                                                       history=history))
        self._changed_at = self._clock.monotonic()
        if self._metrics is not None:
            self._metrics.changes.labels(event.direction, actor).inc()
        self._publish_metrics()
        attributes: dict[str, Any] = {
            "switchboard.degradation.from": int(record.level),
            "switchboard.degradation.to": int(to),
            "switchboard.degradation.actor": actor.value,
            "switchboard.degradation.pinned": pinned,
            "switchboard.degradation.reason": reason,
        }
        with tracer.start_as_current_span("degradation.change", attributes=attributes) as span:
            span.add_event("degradation.level_changed", attributes)
        level_name = f"{int(record.level)} ({record.level.label}) -> {int(to)} ({to.label})"
        log.log(
            logging.WARNING if to > record.level else logging.INFO,
            "degradation %s by %s: %s",
            level_name,
            actor.value,
            reason,
        )
        return event

    def _publish_metrics(self) -> None:
        if self._metrics is not None:
            record = self._store.degradation
            self._metrics.level.set(record.level)
            self._metrics.pinned.set(1 if record.pinned else 0)

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop the ladder
                log.exception("degradation tick failed")
            await asyncio.sleep(self.config.interval_s)


def ladder_config(settings: ControlPlaneSettings) -> LadderConfig:
    """A :class:`LadderConfig` from :class:`~control_plane.settings.ControlPlaneSettings` (the TTFT
    SLO is the autoscaler's, so both act on the same objective)."""
    return LadderConfig(
        ttft_slo_s=settings.ttft_slo_s,
        interval_s=settings.degradation_interval_s,
        raise_dwell_s=settings.degradation_raise_dwell_s,
        lower_dwell_s=settings.degradation_lower_dwell_s,
        lower_dwell_gauge_s=settings.degradation_lower_dwell_gauge_s,
        raise_queue_time_s=settings.degradation_raise_queue_time_s,
    )


__all__ = ["LEVELS", "Assessment", "Clock", "DegradationController", "DegradationMetrics", "LadderConfig",
           "Level", "LevelChange", "assess", "ladder_config", "signals_dict"]
