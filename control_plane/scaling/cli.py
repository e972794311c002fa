"""`switchboard autoscale simulate --trace FILE [--out PNG]`: autoscaling tools.

    switchboard autoscale simulate --trace deploy/traces/ramp.csv --max-replicas 6 --out sim.png
    switchboard autoscale simulate --trace t.json --max-replicas 8 --service-time-s 3 --json out.json

Dispatched by ``switchboard autoscale`` (control_plane/cli.py). ``simulate`` replays the trace
through the real policy (control_plane/scaling/simulate.py), prints every decision and a summary,
and writes the PNG (control_plane/scaling/simulate_plot.py) and optionally the series as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from control_plane.scaling.policy import PolicyConfig
from control_plane.scaling.simulate import ShardModel, load_trace, simulate
from control_plane.scaling.simulate_plot import plot


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: switchboard autoscale simulate --trace FILE [--out PNG] [policy flags]\n\n"
              "  simulate   replay a load trace through the real autoscaling policy and plot it")
        return
    if args[0] != "simulate":
        print(f"switchboard autoscale: unknown action {args[0]!r} (try: simulate)", file=sys.stderr)
        raise SystemExit(2)
    simulate_main(args[1:])


def simulate_main(argv: list[str] | None = None) -> None:
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
