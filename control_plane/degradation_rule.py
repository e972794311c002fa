"""The degradation ladder's automatic rule: one reading of the signals -> hot, calm, hold or incomplete.

Called by the degradation controller (control_plane/degradation.py) on every tick; pure, so its
tests (tests/control_plane/test_degradation.py) drive it with built Signals.

    config = LadderConfig(ttft_slo_s=2.0)
    a = assess(signals, config)          # Assessment(Verdict.HOT, reasons=(...), causes=(Cause.QUEUE_TIME,))
    config.lower_dwell_for(a.causes)     # how long calm must last before a step down

Overload is a queue, not a long prompt. Prefill grows with the prompt, so raw TTFT is never read
here; the rule reads only what means overload (fields of :class:`~control_plane.signals.model.Signals`,
by attribute, so a renamed field is a type error, not a silent calm):

| cause | signal | hot above | calm below | needs pressure | dwell down |
|---|---|---|---|---|---|
| ``waiting`` | ``waiting_per_shard`` | 8 | 2 | no (it is the queue) | gauge (10 s) |
| ``queue_time`` | ``queue_time_p95_s`` | 2 s (the SLO) | 0.5 s | yes | window (30 s) |
| ``ttft_excess`` | ``ttft_excess_p95_s`` | SLO x 1.0 | SLO x 0.5 | yes | window (30 s) |
| ``error_rate`` | ``error_rate`` | 10 % | 2 % | yes | window (30 s) |
| ``kv_usage`` | ``kv_usage`` | 97 % | 85 % | no (it is utilisation) | gauge (10 s) |

*Pressure* is :class:`~control_plane.signals.model.Pressure` (``config.pressure``, the autoscaler's
definition too): a queue now, or busy batches (``batch_usage`` >= 0.75), or KV >= 0.85. Without it
the ladder never rises: a latency
figure over the threshold on an idle fleet is a tail of the window or a slow prompt, and counts as
*hold* (it still blocks a step down until the window has moved past it).

Incomplete: ``complete`` False, or a figure every complete reading must carry (waiting per shard,
batch usage, load and capacity per shard) is None. Latency figures may be None (no request in the
window: no pressure from them).

Dwell down "matches the cause": a level raised by a gauge (waiting, KV) or pinned by an operator
steps down after ``lower_dwell_gauge_s`` of calm, one raised by a windowed figure after
``lower_dwell_s`` (at least the signals' window, so each step's effect is measured before the next).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from control_plane.ladder import WINDOWED_CAUSES, Cause, Verdict
from control_plane.signals.model import Pressure, Signals
from control_plane.slo import TTFT_SLO_S

CAUSES = tuple(Cause)
SHED_FLOOR_PER_S = 0.2
"""Sheds per second below which shedding is noise, not demand held back."""
RETURN_HEADROOM = 0.9
"""Lowering needs the shed demand to fit in this share of the fleet's slots."""


@dataclass(frozen=True)
class LadderConfig:
    """Thresholds and timings of the automatic rule. Raise thresholds sit above lower ones."""

    ttft_slo_s: float = TTFT_SLO_S
    """Target p95 time to first token, seconds (> 0); the TTFT-beyond-prefill thresholds scale with it."""
    raise_ttft_ratio: float = 1.0
    """Hot when TTFT beyond prefill (p95) > SLO x this (under pressure)."""
    lower_ttft_ratio: float = 0.5
    """Calm needs TTFT beyond prefill (p95) < SLO x this."""
    raise_queue_time_s: float = TTFT_SLO_S
    """Hot when time waiting for a slot (p95, admission + shard queue) exceeds this (under pressure):
    by default the TTFT SLO, i.e. queueing alone would miss it."""
    lower_queue_time_s: float = 0.5
    """Calm needs the queue time p95 below this."""
    raise_waiting_per_shard: float = 8.0
    """Hot when requests waiting per healthy shard exceed this."""
    lower_waiting_per_shard: float = 2.0
    """Calm needs waiting per shard below this."""
    raise_error_rate: float = 0.10
    """Hot when the fraction of failed requests exceeds this (under pressure)."""
    lower_error_rate: float = 0.02
    """Calm needs the error rate below this."""
    raise_kv_usage: float = 0.97
    """Hot when KV-cache usage (0..1) exceeds this."""
    lower_kv_usage: float = 0.85
    """Calm needs KV usage below this."""
    pressure: Pressure = field(default_factory=Pressure)
    """When latency figures count at all (shared with the autoscaler)."""
    raise_dwell_s: float = 10.0
    """Least time at a level before the rule raises it again."""
    lower_dwell_s: float = 30.0
    """Calm needed (and time at the level) before a step down, for a level raised by a windowed
    figure (queue time, TTFT beyond prefill, error rate) or of unknown cause (after a restart)."""
    lower_dwell_gauge_s: float = 10.0
    """The same for a level raised by a gauge (waiting, KV usage) or pinned by an operator."""
    interval_s: float = 2.0
    """How often the signals are read."""
    history: int = 200
    """Change events kept (and persisted)."""
    signal_history: int = 150
    """Signal readings kept for the admin API's sparklines."""

    def __post_init__(self) -> None:
        pairs = [
            ("ttft_ratio", self.lower_ttft_ratio, self.raise_ttft_ratio),
            ("queue_time_s", self.lower_queue_time_s, self.raise_queue_time_s),
            ("waiting_per_shard", self.lower_waiting_per_shard, self.raise_waiting_per_shard),
            ("error_rate", self.lower_error_rate, self.raise_error_rate),
            ("kv_usage", self.lower_kv_usage, self.raise_kv_usage),
        ]
        for name, low, high in pairs:
            if not 0 <= low < high:
                raise ValueError(f"{name}: need 0 <= lower ({low}) < raise ({high}) for hysteresis")
        if self.ttft_slo_s <= 0 or self.interval_s <= 0:
            raise ValueError("ttft_slo_s and interval_s must be > 0")
        if min(self.raise_dwell_s, self.lower_dwell_s, self.lower_dwell_gauge_s) < 0:
            raise ValueError("dwell times must be >= 0")
        if self.history < 1 or self.signal_history < 1:
            raise ValueError("history sizes must be >= 1")

    def lower_dwell_for(self, causes: Iterable[Cause]) -> float:
        """Calm needed before stepping down a level raised by `causes` (empty: unknown cause)."""
        seen = set(causes)
        if seen and not seen & WINDOWED_CAUSES:
            return self.lower_dwell_gauge_s
        return self.lower_dwell_s


@dataclass(frozen=True)
class Assessment:
    """The rule's reading of one set of signals."""

    verdict: Verdict
    reasons: tuple[str, ...]
    """Human-readable facts behind the verdict."""
    causes: tuple[Cause, ...] = ()
    """The checks that made it hot."""


@dataclass(frozen=True)
class _Check:
    cause: Cause
    label: str
    value: float | None
    high: float
    low: float
    fmt: str
    needs_pressure: bool


REQUIRED: tuple[tuple[str, Callable[[Signals], float | None]], ...] = (
    ("waiting_per_shard", lambda s: s.waiting_per_shard),
    ("batch_usage", lambda s: s.batch_usage),
    ("load_per_shard", lambda s: s.load_per_shard),
    ("capacity_per_shard", lambda s: s.capacity_per_shard),
)
"""Figures every complete reading carries; None in one of them is an incomplete reading."""


def assess(signals: Signals | None, config: LadderConfig) -> Assessment:
    """Classify `signals` as hot, calm, in between (hold) or incomplete."""
    if signals is None or not signals.complete:
        missing = list(signals.missing) if signals is not None else []
        return Assessment(Verdict.INCOMPLETE, (f"signals incomplete: missing {', '.join(missing) or 'all'}",))
    absent = [name for name, get in REQUIRED if get(signals) is None]
    if absent:
        return Assessment(Verdict.INCOMPLETE, (f"signals incomplete: no {', '.join(absent)}",))
    slo = config.ttft_slo_s
    checks = (
        _Check(Cause.WAITING, "waiting/shard", signals.waiting_per_shard, config.raise_waiting_per_shard,
               config.lower_waiting_per_shard, "{:.1f}", False),
        _Check(Cause.QUEUE_TIME, "queue_time_p95", signals.queue_time_p95_s, config.raise_queue_time_s,
               config.lower_queue_time_s, "{:.2f}s", True),
        _Check(Cause.TTFT_EXCESS, "ttft_beyond_prefill_p95", signals.ttft_excess_p95_s, slo * config.raise_ttft_ratio,
               slo * config.lower_ttft_ratio, "{:.2f}s", True),
        _Check(Cause.ERROR_RATE, "error_rate", signals.error_rate, config.raise_error_rate, config.lower_error_rate,
               "{:.1%}", True),
        _Check(Cause.KV_USAGE, "kv_usage", signals.kv_usage, config.raise_kv_usage, config.lower_kv_usage,
               "{:.0%}", False),
    )
    pressure = config.pressure.on(signals)
    hot: list[str] = []
    causes: list[Cause] = []
    warm: list[str] = []
    for c in checks:
        if c.value is None:  # no data for this dimension (e.g. no requests in the window): no pressure
            continue
        if c.value > c.high and (pressure or not c.needs_pressure):
            hot.append(f"{c.label} {c.fmt.format(c.value)} > {c.fmt.format(c.high)}")
            causes.append(c.cause)
        elif c.value > c.high:
            warm.append(f"{c.label} {c.fmt.format(c.value)} > {c.fmt.format(c.high)} but no queue and "
                        f"batches {signals.batch_usage or 0.0:.0%} full: not overload")
        elif c.value >= c.low:
            warm.append(f"{c.label} {c.fmt.format(c.value)} >= {c.fmt.format(c.low)}")
    if hot:
        return Assessment(Verdict.HOT, tuple(hot), tuple(causes))
    if warm:
        return Assessment(Verdict.HOLD, tuple(warm))
    returning = shed_demand_that_would_not_fit(signals)
    if returning:
        return Assessment(Verdict.HOLD, (returning,))
    return Assessment(Verdict.CALM, ("all signals below their lower thresholds",))


def shed_demand_that_would_not_fit(signals: Signals) -> str | None:
    """Shedding makes the fleet look calm. Before stepping down, estimate (Little's law) how many
    slots the shed demand would occupy if let back in; None when it fits or cannot be judged."""
    shed = signals.shed_per_s
    per_shard, slots = signals.load_per_shard, signals.capacity_per_shard
    healthy = signals.healthy_shards
    if shed <= SHED_FLOOR_PER_S or per_shard is None or not slots or not healthy:
        return None
    demand = sum(signals.demand_by_tier.values())
    admitted = demand - sum(signals.rejections_by_tier.values())
    load = per_shard * healthy
    if admitted <= 0 or load <= 0:
        return None
    extra = shed * load / admitted  # requests/s x seconds each = concurrent requests
    capacity = slots * healthy
    if load + extra <= capacity * RETURN_HEADROOM:
        return None
    return (f"shedding {shed:.1f} req/s; letting it back would need ~{load + extra:.0f} of "
            f"{capacity:.0f} slots")


__all__ = ["CAUSES", "Assessment", "LadderConfig", "assess", "shed_demand_that_would_not_fit"]
