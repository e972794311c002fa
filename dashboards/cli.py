"""`switchboard dashboards COMMAND`: push the dashboards to a Grafana, or check which panels fill.

    switchboard dashboards push --grafana-url URL --token T        # dashboards.push
    switchboard dashboards check --prometheus URL [--dir DIR]      # dashboards.check
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "push": ("dashboards.push", "create or update the dashboards in a Grafana over its HTTP API"),
    "check": ("dashboards.check", "which panels of a folder of dashboards show data in a Prometheus"),
}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        listed = "\n".join(f"  {name:<8} {desc}" for name, (_, desc) in COMMANDS.items())
        print(f"usage: switchboard dashboards COMMAND [ARGS...]\n\ncommands:\n{listed}",
              file=sys.stdout if not args or args[0] in ("-h", "--help") else sys.stderr)
        if args and args[0] not in ("-h", "--help"):
            raise SystemExit(2)
        return
    module = importlib.import_module(COMMANDS[args[0]][0])
    # push's own parser takes the "push" word as its sub-command; check's takes only its flags
    module.main(args if args[0] == "push" else args[1:])


if __name__ == "__main__":
    main()
