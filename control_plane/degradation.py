"""The degradation ladder: how much the platform gives up, raised and lowered from the signals.

    controller = DegradationController(store, source, config=LadderConfig(ttft_slo_s=2.0),
                                       metrics=DegradationMetrics(registry))
    await controller.start()          # named task: read signals every interval_s, maybe step
    controller.pin(3, "incident 42")  # operator: hold level 3 (persisted)
    controller.release("fixed")       # back to automatic, from the level in force
    controller.snapshot()             # {"level", "pinned", "reason", "since", "history", ...}
    await controller.aclose()

The levels (enforced by the gateway, ``data_plane/cluster_state.py``)::

    0 normal            1 shrink context window      2 cap output tokens
    3 shed free tier    4 enterprise only

The automatic rule, evaluated on every read of the signals:

- *hot*: any of TTFT p95 > SLO x ``raise_ttft_ratio``, waiting per shard > ``raise_waiting_per_shard``,
  error rate > ``raise_error_rate``, KV usage > ``raise_kv_usage``. Raises one level once the current
  level has been held ``raise_dwell_s`` (fast up).
- *calm*: every one of them below its (lower) ``lower_*`` threshold. Lowers one level once calm has
  lasted ``lower_dwell_s`` without a break and the level has been held as long (slow down).
- between the two thresholds nothing moves (hysteresis); signals that are incomplete (a shard not
  scraped, a stale metric) or that cannot be read never move the ladder, and they break a calm streak.

While an operator pins a level the rule is still evaluated (and shown) but not applied. Releasing
a pin keeps the level in force and hands it back to the rule, which then walks it down one step at
a time: dropping straight from 4 to 0 would let back all the load that was shed at once.

Every change is an event ``{at, from, to, reason, signals, actor}`` in a bounded history (persisted
with the level by :class:`~control_plane.policy_store.PolicyStore`), a metric, a span with a
``degradation.level_changed`` event, and a log line.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from control_plane.policy_store import MAX_LEVEL, DegradationRecord, PolicyStore
from data_plane.tasks import stop_tasks

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

LEVELS: dict[int, str] = {
    0: "normal",
    1: "shrink_context",
    2: "cap_output_tokens",
    3: "shed_free_tier",
    4: "enterprise_only",
}
ACTORS = ("auto", "operator")
DIRECTIONS = ("up", "down", "none")
OUTCOMES = ("raise", "lower", "hold", "incomplete", "pinned")


class LadderSignals(Protocol):
    """What the ladder reads from a :class:`control_plane.signals.Signals` (None = no data)."""

    complete: bool
    ttft_p95_s: float | None
    error_rate: float | None
    waiting_per_shard: float | None
    kv_usage: float | None


class SignalReader(Protocol):
    """A source of signals; ``read()`` is called once per ``interval_s`` by the controller's task."""

    async def read(self) -> Any: ...


@dataclass(frozen=True)
class LadderConfig:
    """Thresholds and timings of the automatic rule. Raise thresholds sit above lower ones."""

    ttft_slo_s: float = 2.0
    """Target p95 time to first token, seconds."""
    raise_ttft_ratio: float = 1.0
    """Hot when TTFT p95 > SLO x this."""
    lower_ttft_ratio: float = 0.5
    """Calm needs TTFT p95 < SLO x this."""
    raise_waiting_per_shard: float = 8.0
    """Hot when requests waiting per healthy shard exceed this."""
    lower_waiting_per_shard: float = 2.0
    """Calm needs waiting per shard below this."""
    raise_error_rate: float = 0.10
    """Hot when the fraction of failed requests exceeds this."""
    lower_error_rate: float = 0.02
    """Calm needs the error rate below this."""
    raise_kv_usage: float = 0.97
    """Hot when KV-cache usage (0..1) exceeds this."""
    lower_kv_usage: float = 0.85
    """Calm needs KV usage below this."""
    raise_dwell_s: float = 10.0
    """Least time at a level before the rule raises it again."""
    lower_dwell_s: float = 30.0
    """Least time at a level, and of unbroken calm, before the rule lowers it."""
    interval_s: float = 2.0
    """How often the signals are read."""
    history: int = 200
    """Change events kept (and persisted)."""
    signal_history: int = 150
    """Signal readings kept for the admin API's sparklines."""

    def __post_init__(self) -> None:
        pairs = [
            ("ttft_ratio", self.lower_ttft_ratio, self.raise_ttft_ratio),
            ("waiting_per_shard", self.lower_waiting_per_shard, self.raise_waiting_per_shard),
            ("error_rate", self.lower_error_rate, self.raise_error_rate),
            ("kv_usage", self.lower_kv_usage, self.raise_kv_usage),
        ]
        for name, low, high in pairs:
            if not 0 <= low < high:
                raise ValueError(f"{name}: need 0 <= lower ({low}) < raise ({high}) for hysteresis")
        if self.ttft_slo_s <= 0 or self.interval_s <= 0:
            raise ValueError("ttft_slo_s and interval_s must be > 0")
        if self.raise_dwell_s < 0 or self.lower_dwell_s < 0:
            raise ValueError("dwell times must be >= 0")
        if self.history < 1 or self.signal_history < 1:
            raise ValueError("history sizes must be >= 1")


@dataclass(frozen=True)
class Assessment:
    """The rule's reading of one set of signals."""

    verdict: str
    """``hot`` | ``calm`` | ``hold`` | ``incomplete``."""
    reasons: tuple[str, ...]
    """Human-readable facts behind the verdict."""


def assess(signals: Any, config: LadderConfig) -> Assessment:
    """Classify `signals` as hot, calm, in between (hold) or incomplete."""
    if signals is None or not getattr(signals, "complete", False):
        missing = list(getattr(signals, "missing", None) or [])
        return Assessment("incomplete", (f"signals incomplete: missing {', '.join(map(str, missing)) or 'all'}",))
    slo = config.ttft_slo_s
    checks = [  # (name, value, raise above, calm below, format)
        ("ttft_p95", _num(signals, "ttft_p95_s"), slo * config.raise_ttft_ratio, slo * config.lower_ttft_ratio, "{:.2f}s"),
        ("waiting/shard", _num(signals, "waiting_per_shard"), config.raise_waiting_per_shard,
         config.lower_waiting_per_shard, "{:.1f}"),
        ("error_rate", _num(signals, "error_rate"), config.raise_error_rate, config.lower_error_rate, "{:.1%}"),
        ("kv_usage", _num(signals, "kv_usage"), config.raise_kv_usage, config.lower_kv_usage, "{:.0%}"),
    ]
    hot, warm = [], []
    for name, value, high, low, fmt in checks:
        if value is None:  # no data for this dimension (e.g. no requests in the window): no pressure
            continue
        if value > high:
            hot.append(f"{name} {fmt.format(value)} > {fmt.format(high)}")
        elif value >= low:
            warm.append(f"{name} {fmt.format(value)} >= {fmt.format(low)}")
    if hot:
        return Assessment("hot", tuple(hot))
    if warm:
        return Assessment("hold", tuple(warm))
    returning = _shed_demand_that_would_not_fit(signals)
    if returning:
        return Assessment("hold", (returning,))
    return Assessment("calm", ("all signals below their lower thresholds",))


SHED_FLOOR_PER_S = 0.2
"""Sheds per second below which shedding is noise, not demand held back."""
RETURN_HEADROOM = 0.9
"""Lowering needs the shed demand to fit in this share of the fleet's slots."""


def _shed_demand_that_would_not_fit(signals: Any) -> str | None:
    """Shedding makes the fleet look calm. Before stepping down, estimate (Little's law) how many
    slots the shed demand would occupy if let back in; None when it fits or cannot be judged."""
    shed = _num(signals, "shed_per_s") or 0.0
    per_shard, slots = _num(signals, "load_per_shard"), _num(signals, "capacity_per_shard")
    healthy = getattr(signals, "healthy_shards", 0) or 0
    if shed <= SHED_FLOOR_PER_S or per_shard is None or not slots or not healthy:
        return None
    demand = sum(getattr(signals, "demand_by_tier", {}).values())
    admitted = demand - sum(getattr(signals, "rejections_by_tier", {}).values())
    load = per_shard * healthy
    if admitted <= 0 or load <= 0:
        return None
    extra = shed * load / admitted  # requests/s x seconds each = concurrent requests
    capacity = slots * healthy
    if load + extra <= capacity * RETURN_HEADROOM:
        return None
    return (f"shedding {shed:.1f} req/s; letting it back would need ~{load + extra:.0f} of "
            f"{capacity:.0f} slots")


def _num(signals: Any, name: str) -> float | None:
    value = getattr(signals, name, None)
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def signals_dict(signals: Any, *, full: bool = False) -> dict[str, Any]:
    """A JSON-ready dict of a Signals value: its ``summary()`` (no per-shard list) unless `full`."""
    if signals is None:
        return {}
    if not full and hasattr(signals, "summary"):
        data = signals.summary()
    elif hasattr(signals, "to_dict"):
        data = signals.to_dict()
    elif dataclasses.is_dataclass(signals) and not isinstance(signals, type):
        data = dataclasses.asdict(signals)
    elif hasattr(signals, "model_dump"):
        data = signals.model_dump()
    elif isinstance(signals, Mapping):
        data = dict(signals)
    else:
        data = dict(vars(signals))
    return _jsonable(data)


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
        for direction in DIRECTIONS:
            for actor in ACTORS:
                self.changes.labels(direction, actor)
        for outcome in OUTCOMES:
            self.evaluations.labels(outcome)


@dataclass
class _Clock:
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
        clock: _Clock | None = None,
    ) -> None:
        self.config = config or LadderConfig()
        self._store = store
        self._source = source
        self._metrics = metrics
        self._clock = clock or _Clock()
        # dwell restarts at (re)start: a restored level is held at least one dwell time
        self._changed_at = self._clock.monotonic()
        self._calm_since: float | None = None
        self._last_assessment = Assessment("incomplete", ("no signals read yet",))
        self._signals: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.config.signal_history)
        self._latest: Any = None
        self._read_failing = False
        self._task: asyncio.Task[None] | None = None
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
    def level(self) -> int:
        return self._store.degradation.level

    @property
    def pinned(self) -> bool:
        return self._store.degradation.pinned

    @property
    def latest_signals(self) -> Any:
        """The last Signals read (None before the first read)."""
        return self._latest

    def signal_history(self) -> list[dict[str, Any]]:
        """Recent readings, oldest first, each ``{"at": unix_s, **signals}``."""
        return list(self._signals)

    def snapshot(self) -> dict[str, Any]:
        record = self._store.degradation
        assessment = self._last_assessment
        return {
            "level": record.level,
            "name": LEVELS[record.level],
            "pinned": record.pinned,
            "reason": record.reason,
            "since": record.since,
            "automatic": {
                "verdict": assessment.verdict,
                "reasons": list(assessment.reasons),
                "calm_for_s": self._calm_for(),
                "held_for_s": round(self._clock.monotonic() - self._changed_at, 3),
                "raise_dwell_s": self.config.raise_dwell_s,
                "lower_dwell_s": self.config.lower_dwell_s,
            },
            "history": [dict(e) for e in record.history],
        }

    # -- the automatic rule ------------------------------------------------------------------

    async def tick(self) -> dict[str, Any] | None:
        """Read the source once and apply the rule; returns the change event, if any."""
        signals = None
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

    def observe(self, signals: Any) -> dict[str, Any] | None:
        """Apply the rule to one reading; returns the change event if the level moved."""
        now = self._clock.monotonic()
        if signals is not None:
            self._latest = signals
            self._signals.append({"at": self._clock.wall(), **signals_dict(signals)})
        assessment = assess(signals, self.config)
        self._last_assessment = assessment
        if assessment.verdict == "calm":
            if self._calm_since is None:
                self._calm_since = now
        else:
            self._calm_since = None
        record = self._store.degradation
        held = now - self._changed_at
        outcome, target = "hold", record.level
        if assessment.verdict == "incomplete":
            outcome = "incomplete"
        elif record.pinned:
            outcome = "pinned"
        elif assessment.verdict == "hot" and record.level < MAX_LEVEL and held >= self.config.raise_dwell_s:
            outcome, target = "raise", record.level + 1
        elif (
            assessment.verdict == "calm"
            and record.level > 0
            and held >= self.config.lower_dwell_s
            and self._calm_for() >= self.config.lower_dwell_s
        ):
            outcome, target = "lower", record.level - 1
        if self._metrics is not None:
            self._metrics.evaluations.labels(outcome).inc()
        if target == record.level:
            return None
        if outcome == "lower":
            reason = f"calm for {self._calm_for():.0f}s: " + "; ".join(assessment.reasons)
        else:
            reason = "; ".join(assessment.reasons)
        event = self._change(target, reason, actor="auto", pinned=False, signals=signals)
        if outcome == "lower":
            self._calm_since = now  # the next step down needs a fresh calm period at the new level
        return event

    # -- operator --------------------------------------------------------------------------

    def pin(self, level: int, reason: str) -> dict[str, Any]:
        """Hold `level` until `release`; takes effect at once (no dwell, any distance)."""
        if not 0 <= level <= MAX_LEVEL:
            raise ValueError(f"level must be 0..{MAX_LEVEL}")
        return self._change(level, f"pinned: {reason}", actor="operator", pinned=True, signals=self._latest)

    def release(self, reason: str = "released") -> dict[str, Any] | None:
        """Hand the level back to the automatic rule (from where it stands); None if not pinned."""
        record = self._store.degradation
        if not record.pinned:
            return None
        return self._change(record.level, f"released: {reason}", actor="operator", pinned=False, signals=self._latest)

    # -- internals -------------------------------------------------------------------------

    def _calm_for(self) -> float:
        return 0.0 if self._calm_since is None else round(self._clock.monotonic() - self._calm_since, 3)

    def _change(self, to: int, reason: str, *, actor: str, pinned: bool, signals: Any) -> dict[str, Any]:
        record = self._store.degradation
        at = self._clock.wall()
        event = {
            "at": at,
            "from": record.level,
            "to": to,
            "reason": reason,
            "signals": signals_dict(signals),
            "actor": actor,
            "pinned": pinned,
        }
        history = (*record.history, event)[-self.config.history:]
        self._store.save_degradation(DegradationRecord(level=to, reason=reason, pinned=pinned, since=at,
                                                       history=history))
        self._changed_at = self._clock.monotonic()
        direction = "up" if to > record.level else "down" if to < record.level else "none"
        if self._metrics is not None:
            self._metrics.changes.labels(direction, actor).inc()
        self._publish_metrics()
        attributes: dict[str, Any] = {
            "switchboard.degradation.from": record.level,
            "switchboard.degradation.to": to,
            "switchboard.degradation.actor": actor,
            "switchboard.degradation.pinned": pinned,
            "switchboard.degradation.reason": reason,
        }
        with tracer.start_as_current_span("degradation.change", attributes=attributes) as span:
            span.add_event("degradation.level_changed", attributes)
        level_name = f"{record.level} ({LEVELS[record.level]}) -> {to} ({LEVELS[to]})"
        log.log(
            logging.WARNING if to > record.level else logging.INFO,
            "degradation %s by %s: %s",
            level_name,
            actor,
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


def ladder_config(settings: Any) -> LadderConfig:
    """A :class:`LadderConfig` from :class:`~control_plane.settings.ControlPlaneSettings` (the TTFT
    SLO is the autoscaler's, when the settings have one, so both act on the same objective)."""
    return LadderConfig(
        ttft_slo_s=getattr(settings, "ttft_slo_s", LadderConfig.ttft_slo_s),
        interval_s=settings.degradation_interval_s,
        raise_dwell_s=settings.degradation_raise_dwell_s,
        lower_dwell_s=settings.degradation_lower_dwell_s,
    )
