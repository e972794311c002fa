"""`switchboard autoscale simulate --trace FILE [--out PNG]`: autoscaling tools.

    switchboard autoscale simulate --trace deploy/traces/ramp.csv --max-replicas 6 --out sim.png
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: switchboard autoscale simulate --trace FILE [--out PNG] [policy flags]\n\n"
              "  simulate   replay a load trace through the real autoscaling policy and plot it")
        return
    if args[0] != "simulate":
        print(f"switchboard autoscale: unknown action {args[0]!r} (try: simulate)", file=sys.stderr)
        raise SystemExit(2)
    from control_plane.scaling.simulate import main as simulate

    simulate(args[1:])
