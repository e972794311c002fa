"""`switchboard autoscale simulate --trace FILE [--out PNG]`: autoscaling tools.

    switchboard autoscale simulate --trace deploy/traces/ramp.csv --max-replicas 6 --out sim.png
    switchboard autoscale simulate --trace t.json --max-replicas 8 --service-time-s 3 --json-out out.json

Dispatched by ``switchboard autoscale`` (control_plane/cli.py). ``simulate`` replays the trace
through the real policy (control_plane/scaling/simulate.py), prints every decision and a summary,
and writes the PNG (control_plane/scaling/simulate_plot.py) and optionally the series as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from control_plane.scaling.policy import PolicyConfig, policy_config
from control_plane.scaling.simulate import ShardModel, load_trace, simulate
from control_plane.scaling.simulate_plot import plot
from data_plane.common.settings_cli import parse_settings


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


_POLICY, _SHARD = PolicyConfig(), ShardModel()


class SimulateSettings(BaseSettings):
    """Replay a load trace through the autoscaling policy; write a PNG."""

    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_SIMULATE_", use_attribute_docstrings=True)
    FLAG_ALIASES: ClassVar[dict[str, str]] = {"--json": "json_out"}
    """Deprecated flag spellings (data_plane/common/settings_cli.py)."""
    TLS: ClassVar[bool] = False
    """An offline replay: no TLS flags in its --help."""

    trace: str
    """CSV or JSON: time_s, and arrival_rate or waiting."""
    out: str = "autoscale-sim.png"
    """PNG to write."""
    json_out: str | None = None
    """Also write the series and decisions as JSON here."""
    min_replicas: int = Field(_POLICY.min_replicas, ge=0, le=1000)
    """Fewest shards the policy keeps."""
    max_replicas: int = Field(_POLICY.max_replicas, ge=1, le=1000)
    """Most shards the policy runs."""
    start_replicas: int | None = Field(None, ge=0, le=1000)
    """Shards at t=0 (default: min replicas)."""
    target_waiting_per_shard: float = Field(_POLICY.target_waiting_per_shard, gt=0)
    """Requests waiting for a batch slot per shard that the fleet is sized for."""
    ttft_slo_s: float = Field(_POLICY.ttft_slo_s, gt=0)
    """Time-to-first-token p95 objective, seconds."""
    target_queue_time_s: float = Field(_POLICY.target_queue_time_s, gt=0)
    """Queue time p95 (admission wait + shard queue), seconds, that the fleet is sized for."""
    scale_up_cooldown_s: float = Field(_POLICY.scale_up_cooldown_s, ge=0)
    """Least seconds after a scaling before scaling up again."""
    scale_down_cooldown_s: float = Field(_POLICY.scale_down_cooldown_s, ge=0)
    """Least seconds after a scaling before scaling down."""
    interval_s: float = Field(5.0, gt=0)
    """Seconds between decisions."""
    window_s: float = Field(30.0, gt=0)
    """TTFT p95 window, seconds."""
    slots: int = Field(_SHARD.slots, ge=1)
    """Batch slots per simulated shard."""
    service_time_s: float = Field(_SHARD.service_time_s, gt=0)
    """Seconds a request holds a slot."""
    prefill_s: float = Field(_SHARD.prefill_s, ge=0)
    """TTFT without a queue, seconds."""
    startup_s: float = Field(_SHARD.startup_s, ge=0)
    """Shard start-up time, seconds."""


def simulate_main(argv: list[str] | None = None) -> None:
    """``switchboard autoscale simulate`` (argv: the flags after ``simulate``)."""
    prog = "switchboard autoscale simulate"
    args = parse_settings(SimulateSettings, argv, prog=prog)
    try:
        config = policy_config(args)
        model = ShardModel(args.slots, args.service_time_s, args.prefill_s, args.startup_s)
        points = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
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
        print(f"{prog}: the PNG needs matplotlib (pip install matplotlib)", file=sys.stderr)
        raise SystemExit(2) from None
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
