"""The processes `switchboard up` supervises, for operators: which one restarted, when, and how it died.

    table = ProcessTable(state / "processes.json", ProcessMetrics(registry))
    table.read()   # {"supervisor": True, "launcher_pid": ..., "updated_at": ..., "processes": [...]}

`up`'s supervisor (control_plane/supervisor.py) writes the file whenever a child starts, dies or is
restarted: per process its pid, URL, log, start time, restarts and last exit (code, signal, time). The
control plane (``--processes-file``, set by `up`) serves it at ``GET /admin/v1/processes``, shows it in
`switchboard admin status` and the console's Cluster page, and exports it as metrics.

Why: after a kill -9 (or an OOM kill) the supervisor restarted the process within seconds and said so
only on the launcher's terminal; membership showed every member passing, ``/metrics`` had no restart
count, and an operator arriving after the incident could not tell that anything had happened, which
process, or when. The file lives in the state dir, so it outlives a restart of the control plane itself
(whose own restarts it also counts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from control_plane.json_files import write_json_atomic

FILE_NAME = "processes.json"


def write_process_table(path: Path, launcher_pid: int, processes: list[dict[str, Any]], now: float) -> None:
    """Replace the table (whole, renamed into place); `processes`: one dict per child (see read())."""
    write_json_atomic(path, {"launcher_pid": launcher_pid, "updated_at": now, "processes": processes})


class ProcessMetrics:
    """`up`'s children, one series each (the children `up` planned: a bounded set of names)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.restarts = Gauge("switchboard_up_process_restarts",
                              "Times `switchboard up` restarted this process since the launcher started "
                              "(a gauge read from its table, 0 again when up restarts: alert on increase(), which reads that as a reset).",
                              ["process"], registry=registry)
        self.running = Gauge("switchboard_up_process_running",
                             "1 while the supervisor's child is running, 0 while it waits to be restarted.",
                             ["process"], registry=registry)
        self.started = Gauge("switchboard_up_process_start_time_seconds",
                             "When the process's current run started, Unix seconds.", ["process"], registry=registry)
        self.last_exit = Gauge("switchboard_up_process_last_exit_time_seconds",
                               "When the process last died, Unix seconds (0: never since the launcher started).",
                               ["process"], registry=registry)

    def update(self, processes: list[dict[str, Any]]) -> None:
        for p in processes:
            name = str(p.get("name"))
            self.restarts.labels(name).set(float(p.get("restarts") or 0))
            self.running.labels(name).set(1.0 if p.get("running") else 0.0)
            self.started.labels(name).set(float(p.get("started_at") or 0))
            self.last_exit.labels(name).set(float(p.get("last_exit_at") or 0))


class _Refresh:
    """A collector that yields nothing and refreshes the gauges from the file first: registered before
    them, it runs before them at every scrape."""

    def __init__(self, table: ProcessTable) -> None:
        self._table = table

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self._table.read()
        return []


class ProcessTable:
    """The supervisor's file, read on demand (admin API, scrape); absent or unreadable: no supervisor."""

    def __init__(self, path: Path, registry: CollectorRegistry | None = None) -> None:
        self.path = path
        self.metrics: ProcessMetrics | None = None
        if registry is not None:
            registry.register(_Refresh(self))  # type: ignore[arg-type]
            self.metrics = ProcessMetrics(registry)

    def read(self) -> dict[str, Any]:
        try:
            body = json.loads(self.path.read_text())
            processes = [p for p in body.get("processes") or [] if isinstance(p, dict) and isinstance(p.get("name"), str)]
        except (OSError, ValueError, AttributeError):
            return {"supervisor": False, "launcher_pid": None, "updated_at": None, "processes": []}
        if self.metrics is not None:
            self.metrics.update(processes)
        return {"supervisor": True, "launcher_pid": body.get("launcher_pid"), "updated_at": body.get("updated_at"),
                "processes": processes}


__all__ = ["FILE_NAME", "ProcessMetrics", "ProcessTable", "write_process_table"]
