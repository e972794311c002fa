"""``switchboard autoscale simulate``: replay a load trace through the real autoscaling policy.

    switchboard autoscale simulate --trace deploy/traces/ramp.csv --out docs/img/autoscale-sim.png
    switchboard autoscale simulate --trace t.json --max-replicas 8 --service-time-s 3 --json out.json

    result = simulate(load_trace("ramp.csv"), PolicyConfig(max_replicas=6), ShardModel())
    plot(result, "sim.png")                     # control_plane/scaling/simulate_plot.py

The command line is control_plane/scaling/cli.py; tests/control_plane/test_autoscaler.py drives
:func:`simulate` directly.

The trace is CSV (header row) or JSON (a list of objects, or ``{"points": [...]}``) with
``time_s`` and either ``arrival_rate`` (requests/s arriving; the queue is modelled) or
``waiting`` (requests waiting in total, replayed as observed); values are interpolated linearly
between points. The same :class:`~control_plane.scaling.policy.TargetTracking` the control plane
runs decides every ``--interval-s`` on signals built from a fluid model of the shards:

- each ready shard runs up to ``slots`` requests at once, each taking ``service_time_s``,
  so a shard serves ``slots / service_time_s`` requests/s; the rest wait;
- TTFT = ``prefill_s`` + the time to work off the queue ahead (Little's law), and the TTFT p95
  the policy sees is taken over the last ``window_s`` of arrivals, as the real signals are;
- a new shard is ready ``startup_s`` after it is asked for; a removed one stops taking work at
  once and its capacity is gone (its requests finish elsewhere in this model).

"""

from __future__ import annotations

import csv
import json
import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from control_plane.scaling.policy import PolicyConfig, TargetTracking
from control_plane.signals.model import ShardSignal, Signals


@dataclass(frozen=True)
class TracePoint:
    time_s: float
    arrival_rate: float | None = None
    waiting: float | None = None


@dataclass(frozen=True)
class ShardModel:
    """The fluid model of one shard (defaults: the synthetic/torch engine on a small CPU)."""

    slots: int = 16
    """Requests decoded together (``--max-num-seqs``)."""
    service_time_s: float = 4.0
    """Seconds one request holds a slot (prefill + decode)."""
    prefill_s: float = 0.3
    """TTFT with no queue."""
    startup_s: float = 20.0
    """Seconds from asking for a shard to it serving."""


@dataclass
class SimResult:
    config: PolicyConfig
    model: ShardModel
    t: list[float] = field(default_factory=list)
    arrival_rate: list[float] = field(default_factory=list)
    capacity_rps: list[float] = field(default_factory=list)
    desired: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    waiting_per_shard: list[float] = field(default_factory=list)
    ttft_p95_s: list[float | None] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ttfts = [v for v in self.ttft_p95_s if v is not None]
        over = sum(1 for v in ttfts if v > self.config.ttft_slo_s)
        actions: dict[str, int] = {}
        for d in self.decisions:
            actions[d["action"]] = actions.get(d["action"], 0) + 1
        return {
            "duration_s": self.t[-1] if self.t else 0.0,
            "peak_replicas": max(self.desired, default=0),
            "replica_seconds": sum(self.ready),
            "ttft_p95_max_s": max(ttfts, default=None),
            "share_of_time_over_slo": over / len(ttfts) if ttfts else 0.0,
            "scalings": actions,
        }


def load_trace(path: str | Path) -> list[TracePoint]:
    """Points of a CSV or JSON trace, sorted by time (see the module docstring)."""
    path = Path(path)
    text = path.read_text()
    rows: list[dict[str, Any]]
    if path.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        data = json.loads(text)
        rows = data["points"] if isinstance(data, dict) else data
    else:
        rows = list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))
    points = []
    for i, row in enumerate(rows):
        try:
            t = float(row["time_s"])
            rate = row.get("arrival_rate")
            waiting = row.get("waiting")
            point = TracePoint(
                t,
                None if rate in (None, "") else float(rate),
                None if waiting in (None, "") else float(waiting),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}: row {i + 1}: need time_s and arrival_rate or waiting ({exc})"
            ) from None
        if point.arrival_rate is None and point.waiting is None:
            raise ValueError(f"{path}: row {i + 1}: need arrival_rate or waiting")
        points.append(point)
    if len(points) < 2:
        raise ValueError(f"{path}: a trace needs at least two points")
    return sorted(points, key=lambda p: p.time_s)


def _interp(points: list[TracePoint], times: list[float], t: float, attr: str) -> float | None:
    def value(p: TracePoint) -> float | None:
        v: float | None = getattr(p, attr)
        return v

    i = bisect_right(times, t)
    if i == 0:
        return value(points[0])
    if i >= len(points):
        return value(points[-1])
    a, b = points[i - 1], points[i]
    va, vb = value(a), value(b)
    if va is None or vb is None:
        return va if vb is None else vb
    span = b.time_s - a.time_s
    return va + (vb - va) * ((t - a.time_s) / span if span > 0 else 1.0)


def fleet_signals(
    *,
    at: float,
    ready: int,
    running: float,
    waiting: float,
    slots: float,
    ttft_p95_s: float | None,
    window_s: float,
    source: str = "simulation",
    queue_time_p95_s: float | None = None,
    prefill_p95_s: float | None = None,
) -> Signals:
    """Signals of `ready` identical shards sharing `running` and `waiting` (the simulator's and the
    tests' way to feed the policy what ScrapeSignals would read). TTFT beyond prefill is
    ``ttft_p95_s - prefill_p95_s`` (the whole TTFT without a prefill figure)."""
    shards = tuple(
        ShardSignal(
            f"shard-{i}",
            running=running / ready,
            waiting=waiting / ready,
            kv_usage=0.0,
            max_num_seqs=float(slots),
            ttft_p95_s=ttft_p95_s,
            error=None,
            stale=False,
        )
        for i in range(ready)
    )
    missing = () if ready else ("shards: none passing",)
    return Signals(
        at=at,
        shards=shards,
        healthy_shards=ready,
        waiting_per_shard=waiting / ready if ready else None,
        ttft_p95_s=ttft_p95_s,
        error_rate=0.0,
        tokens_per_s=None,
        kv_usage=0.0 if ready else None,
        demand_by_tier={},
        rejections_by_tier={},
        complete=not missing,
        missing=missing,
        load_per_shard=(running + waiting) / ready if ready else None,
        capacity_per_shard=float(slots) if ready else None,
        window_s=window_s,
        source=source,
        batch_usage=min(1.0, running / (ready * slots)) if ready and slots else None,
        queue_time_p95_s=queue_time_p95_s,
        prefill_p95_s=prefill_p95_s,
        shard_ttft_p95_s=ttft_p95_s,
        ttft_excess_p95_s=None if ttft_p95_s is None else max(0.0, ttft_p95_s - (prefill_p95_s or 0.0)),
    )


def _weighted_p95(samples: deque[tuple[float, float, float]]) -> float | None:
    """p95 of TTFT samples weighted by the arrivals they stand for."""
    total = sum(w for _, w, _ in samples)
    if total <= 0:
        return None
    acc = 0.0
    for value, weight in sorted((v, w) for _, w, v in samples):
        acc += weight
        if acc >= 0.95 * total:
            return value
    return None


def simulate(
    points: list[TracePoint],
    config: PolicyConfig,
    model: ShardModel,
    *,
    interval_s: float = 5.0,
    window_s: float = 30.0,
    dt: float = 0.5,
    start_replicas: int | None = None,
) -> SimResult:
    policy = TargetTracking(config)
    times = [p.time_s for p in points]
    replay_waiting = points[0].arrival_rate is None
    per_shard_rps = model.slots / model.service_time_s
    desired = config.min_replicas if start_replicas is None else start_replicas
    ready_at: list[float] = [-math.inf] * desired  # when each asked-for shard serves
    in_system = 0.0  # requests running or waiting (arrival-rate traces)
    ttft_window: deque[tuple[float, float, float]] = deque()  # (t, arrivals, ttft)
    result = SimResult(config, model)
    t, next_tick, end = points[0].time_s, points[0].time_s, points[-1].time_s
    while t <= end + 1e-9:
        ready = sum(1 for r in ready_at if r <= t)
        capacity = ready * model.slots
        if replay_waiting:
            waiting = _interp(points, times, t, "waiting") or 0.0
            running = float(capacity) if waiting > 0 else 0.0
            rate = None
        else:
            rate = _interp(points, times, t, "arrival_rate") or 0.0
            in_system += rate * dt
            running = min(in_system, float(capacity))
            in_system = max(0.0, in_system - running * dt / model.service_time_s)
            waiting = in_system - min(in_system, float(capacity))
            running = min(in_system, float(capacity))
        drain_rps = ready * per_shard_rps
        ttft = model.prefill_s + (waiting / drain_rps if drain_rps > 0 else 60.0)
        ttft_window.append((t, (rate if rate is not None else 1.0) * dt, ttft))
        while ttft_window and ttft_window[0][0] < t - window_s:
            ttft_window.popleft()
        p95 = _weighted_p95(ttft_window)
        if t >= next_tick:
            next_tick += interval_s
            signals = fleet_signals(
                at=t,
                ready=ready,
                running=running,
                waiting=waiting,
                slots=model.slots,
                ttft_p95_s=p95,
                window_s=min(window_s, t - points[0].time_s),
                queue_time_p95_s=None if p95 is None else max(0.0, p95 - model.prefill_s),
                prefill_p95_s=model.prefill_s,
            )
            proposal = policy.decide(signals, desired, t)
            if proposal.desired != desired:
                result.decisions.append(
                    {
                        "t": t,
                        "action": proposal.action,
                        "from": desired,
                        "to": proposal.desired,
                        "reason": proposal.reason,
                    }
                )
                if proposal.desired > desired:
                    ready_at += [t + model.startup_s] * (proposal.desired - desired)
                else:  # the newest go first, as the local actuator does
                    ready_at = sorted(ready_at)[: proposal.desired]
                desired = proposal.desired
        result.t.append(t)
        result.arrival_rate.append(rate if rate is not None else math.nan)
        result.capacity_rps.append(drain_rps)
        result.desired.append(desired)
        result.ready.append(ready)
        result.waiting_per_shard.append(waiting / ready if ready else math.nan)
        result.ttft_p95_s.append(p95)
        t += dt
    return result
