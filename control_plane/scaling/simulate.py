"""``switchboard autoscale simulate``: replay a load trace through the real autoscaling policy.

    switchboard autoscale simulate --trace deploy/traces/ramp.csv --out docs/img/autoscale-sim.png
    switchboard autoscale simulate --trace t.json --max-replicas 8 --service-time-s 3 --json out.json

    result = simulate(load_trace("ramp.csv"), PolicyConfig(max_replicas=6), ShardModel())
    plot(result, "sim.png")

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

The PNG shows load vs capacity, replicas (asked for and ready) with the bounds, and TTFT p95 vs
the SLO, with every scaling decision marked.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
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


def plot(result: SimResult, out: str | Path, title: str = "") -> None:
    """A three-panel PNG: load vs capacity, replicas, TTFT p95 vs SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result.config
    t = result.t
    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [1.1, 1, 1.1]}
    )
    if not all(math.isnan(v) for v in result.arrival_rate):
        ax1.plot(t, result.arrival_rate, color="tab:blue", lw=2, label="arrivals (req/s)")
        ax1.plot(
            t,
            result.capacity_rps,
            color="tab:green",
            lw=1.5,
            ls="--",
            label="capacity of serving shards (req/s)",
        )
        ax1.set_ylabel("requests / s")
    else:
        ax1.plot(
            t,
            [w * r for w, r in zip(result.waiting_per_shard, result.ready, strict=True)],
            color="tab:blue",
            lw=2,
            label="waiting (replayed)",
        )
        ax1.set_ylabel("requests waiting")
    ax1.set_title(
        title or "Autoscaling simulation: the real TargetTracking policy on a fluid shard model", fontsize=12
    )
    ax1.set_ylim(0, max(max(result.capacity_rps, default=1.0), 1.0) * 1.3)
    ax1.legend(loc="upper right", fontsize=9, ncol=2)
    ax1.grid(alpha=0.3)

    ax2.step(t, result.desired, where="post", color="tab:orange", lw=2, label="replicas asked for")
    ax2.step(t, result.ready, where="post", color="tab:purple", lw=1.5, ls="--", label="replicas serving")
    ax2.axhline(cfg.max_replicas, color="grey", ls=":", lw=1)
    ax2.axhline(cfg.min_replicas, color="grey", ls=":", lw=1)
    ax2.text(t[-1], cfg.max_replicas, "max ", ha="right", va="bottom", fontsize=8, color="grey")
    ax2.text(t[-1], cfg.min_replicas, "min ", ha="right", va="bottom", fontsize=8, color="grey")
    for d in result.decisions:
        up = d["to"] > d["from"]
        ax2.annotate(
            "▲" if up else "▼",
            (d["t"], d["to"]),
            color="tab:red" if up else "tab:blue",
            ha="center",
            va="bottom" if up else "top",
            fontsize=10,
        )
    ax2.set_ylabel("shards")
    ax2.set_ylim(0, cfg.max_replicas + 2)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.legend(loc="upper right", fontsize=9, ncol=2)
    ax2.grid(alpha=0.3)

    ttft = [math.nan if v is None else v for v in result.ttft_p95_s]
    ax3.plot(t, ttft, color="tab:red", lw=2, label="TTFT p95 (window)")
    ax3.axhline(cfg.ttft_slo_s, color="black", ls="--", lw=1.2, label=f"SLO {cfg.ttft_slo_s:g} s")
    ax3.fill_between(
        t,
        cfg.ttft_slo_s,
        ttft,
        where=[v > cfg.ttft_slo_s for v in ttft],
        color="tab:red",
        alpha=0.15,
        interpolate=True,
    )
    ax3.set_ylabel("seconds")
    ax3.set_xlabel("time (s)")
    finite = [v for v in ttft if not math.isnan(v)]
    ax3.set_ylim(0, max(cfg.ttft_slo_s * 2.5, min(max(finite, default=1.0) * 1.3, cfg.ttft_slo_s * 8)))
    ax3.legend(loc="upper right", fontsize=9, ncol=2)
    ax3.grid(alpha=0.3)

    s = result.summary()
    note = (
        f"target waiting/shard {cfg.target_waiting_per_shard:g} · "
        f"cooldowns up {cfg.scale_up_cooldown_s:g}s / "
        f"down {cfg.scale_down_cooldown_s:g}s · shard: {result.model.slots} slots × "
        f"{result.model.service_time_s:g}s, ready after {result.model.startup_s:g}s · "
        f"over SLO {s['share_of_time_over_slo']:.0%} of the time"
    )
    fig.text(0.5, 0.005, note, ha="center", fontsize=8.5, color="dimgrey")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """``switchboard autoscale simulate`` (argv: the flags after ``simulate``)."""
    p = argparse.ArgumentParser(
        prog="switchboard autoscale simulate",
        description="Replay a load trace through the autoscaling policy; write a PNG.",
    )
    p.add_argument("--trace", required=True, help="CSV or JSON: time_s, and arrival_rate or waiting")
    p.add_argument("--out", default="autoscale-sim.png", help="PNG to write (default autoscale-sim.png)")
    p.add_argument("--json", dest="json_out", help="also write the series and decisions as JSON here")
    d = PolicyConfig()
    p.add_argument("--min-replicas", type=int, default=d.min_replicas)
    p.add_argument("--max-replicas", type=int, default=d.max_replicas)
    p.add_argument("--start-replicas", type=int, help="shards at t=0 (default min-replicas)")
    p.add_argument("--target-waiting-per-shard", type=float, default=d.target_waiting_per_shard)
    p.add_argument("--ttft-slo-s", type=float, default=d.ttft_slo_s)
    p.add_argument("--scale-up-cooldown-s", type=float, default=d.scale_up_cooldown_s)
    p.add_argument("--scale-down-cooldown-s", type=float, default=d.scale_down_cooldown_s)
    p.add_argument("--interval-s", type=float, default=5.0, help="seconds between decisions (5)")
    p.add_argument("--window-s", type=float, default=30.0, help="TTFT p95 window (30)")
    m = ShardModel()
    p.add_argument("--slots", type=int, default=m.slots, help=f"batch slots per shard ({m.slots})")
    p.add_argument(
        "--service-time-s",
        type=float,
        default=m.service_time_s,
        help=f"seconds a request holds a slot ({m.service_time_s:g})",
    )
    p.add_argument(
        "--prefill-s", type=float, default=m.prefill_s, help=f"TTFT without a queue ({m.prefill_s:g})"
    )
    p.add_argument(
        "--startup-s", type=float, default=m.startup_s, help=f"shard start-up time ({m.startup_s:g})"
    )
    args = p.parse_args(argv)
    try:
        config = PolicyConfig(
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_waiting_per_shard=args.target_waiting_per_shard,
            ttft_slo_s=args.ttft_slo_s,
            scale_up_cooldown_s=args.scale_up_cooldown_s,
            scale_down_cooldown_s=args.scale_down_cooldown_s,
        )
        model = ShardModel(args.slots, args.service_time_s, args.prefill_s, args.startup_s)
        points = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        p.exit(2, f"switchboard autoscale simulate: {exc}\n")
    result = simulate(
        points,
        config,
        model,
        interval_s=args.interval_s,
        window_s=args.window_s,
        start_replicas=args.start_replicas,
    )
    try:
        plot(result, args.out, title=f"Autoscaling simulation of {Path(args.trace).name}")
    except ImportError:
        p.exit(2, "switchboard autoscale simulate: the PNG needs matplotlib (pip install matplotlib)\n")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "summary": result.summary(),
                    "decisions": result.decisions,
                    "series": {
                        k: getattr(result, k) for k in ("t", "arrival_rate", "desired", "ready", "ttft_p95_s")
                    },
                },
                default=lambda v: None,
            )
        )
    for dec in result.decisions:
        print(f"t={dec['t']:7.1f}s  {dec['action']:<10} {dec['from']} -> {dec['to']}  {dec['reason']}")
    print(json.dumps(result.summary()))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
