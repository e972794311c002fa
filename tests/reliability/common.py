"""Helpers of the reliability suite only: RSS, figures, a cluster whose control plane restarts.

    kb = rss_kb(shard.proc.pid)
    report("cp_outage", requests=40, recovered_s=1.2)                          # a figure for the doc

Metrics, polling and chat calls are in tests/support (metrics, waits, chat).

Figures are printed as one ``RELIABILITY name {json}`` line each (run pytest with ``-s`` to see
them) and, when ``SWITCHBOARD_RELIABILITY_REPORT`` names a file, appended to it as JSON lines:
docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.procs import Service

ENV_REPORT = "SWITCHBOARD_RELIABILITY_REPORT"
"""File the suite appends its figures to (JSON lines); unset: printed only."""
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def rss_kb(pid: int) -> int:
    """Resident set size of a live process, from /proc/PID/status (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def all_services(c: Cluster) -> list[Service]:
    return [c.control_plane, *c.caches, *c.shards, c.gateway]


def report(name: str, **figures: Any) -> None:
    """Print a figure line for the doc (and append it to $SWITCHBOARD_RELIABILITY_REPORT)."""
    line = json.dumps({"name": name, **figures}, sort_keys=True, default=str)
    print(f"\nRELIABILITY {name} {line}")
    path = os.environ.get(ENV_REPORT)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class StatefulCluster(Cluster):
    """A :class:`~tests.support.cluster.Cluster` whose control plane persists to `state_dir`, so it can be
    killed and restarted on the same port with its tier policy and degradation level."""

    def __init__(self, state_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_dir = state_dir
        self.control_plane = self._control_plane(self.control_plane.port)

    def _control_plane(self, port: int) -> Service:
        return Service(
            ["control-plane", "--admin-token", ADMIN_TOKEN, "--state-dir", str(self.state_dir)], port=port
        )

    def restart_control_plane(self) -> None:
        old = self.control_plane
        old.stop()  # already dead: closes its log
        self.control_plane = self._control_plane(old.port)
        self.control_plane.start()
