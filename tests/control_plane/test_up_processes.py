"""After an incident the operator can see which process `switchboard up` restarted, when and how it died
(control_plane/admin/processes.py): `switchboard admin status` / `processes`, ``/admin/v1/processes`` and
the control plane's ``switchboard_up_process_*`` metrics.

A kill -9 of a cache node, a shard or the control plane itself was restarted within seconds and said so
only on the launcher's terminal: every member showed passing, /metrics had no restart count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.metrics import scrape, up_headers
from tests.support.procs import free_port, start_up, stop_up, switchboard, wait_up


def _table(cp: int, token: str) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{cp}/admin/v1/processes", headers={"Authorization": f"Bearer {token}"},
                     timeout=5).json()


def _restarted(cp: int, token: str, name: str, old_pid: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        try:
            row = next(p for p in _table(cp, token)["processes"] if p["name"] == name)
            if row["running"] and row["pid"] != old_pid:
                return row
        except httpx.HTTPError:  # the control plane itself is restarting
            pass
        assert time.monotonic() < deadline, f"{name} not restarted"
        time.sleep(0.3)


def test_admin_status_and_metrics_show_which_process_restarted_when_and_how(tmp_path: Path) -> None:
    gw, cp = free_port(), free_port()
    proc: subprocess.Popen[bytes] = start_up(tmp_path, "--engine", "synthetic", "--gateway-port", str(gw),
                                             "--control-plane-port", str(cp), "--no-console", "--shards", "1",
                                             "--cache-nodes", "1")
    try:
        wait_up(proc, tmp_path)
        token = json.loads((tmp_path / ".switchboard" / "credentials.json").read_text())["admin_token"]
        table = _table(cp, token)
        assert table["supervisor"] is True and table["launcher_pid"] == proc.pid
        rows = {p["name"]: p for p in table["processes"]}
        assert set(rows) == {"control-plane", "cache-0", "shard-0", "gateway"}
        assert all(p["running"] and p["restarts"] == 0 and p["last_exit_code"] is None for p in rows.values())

        killed_at = time.time()
        os.kill(rows["cache-0"]["pid"], signal.SIGKILL)
        cache = _restarted(cp, token, "cache-0", rows["cache-0"]["pid"])
        assert cache["restarts"] == 1 and cache["last_exit_code"] == -signal.SIGKILL
        assert killed_at - 1 <= cache["last_exit_at"] <= cache["started_at"] <= time.time()

        os.kill(rows["control-plane"]["pid"], signal.SIGKILL)  # its own restart, seen once it is back
        assert _restarted(cp, token, "control-plane", rows["control-plane"]["pid"])["restarts"] == 1

        metrics = scrape(f"http://127.0.0.1:{cp}", up_headers(tmp_path / ".switchboard"))
        assert 'switchboard_up_process_restarts{process="cache-0"} 1.0' in metrics
        assert 'switchboard_up_process_restarts{process="shard-0"} 0.0' in metrics
        assert 'switchboard_up_process_running{process="gateway"} 1.0' in metrics

        status = switchboard("admin", "status", cwd=tmp_path, timeout=30)
        assert status.returncode == 0, status.stderr
        assert "restarts  control-plane x1, cache-0 x1" in status.stdout, status.stdout
        listing = switchboard("admin", "processes", cwd=tmp_path, timeout=30)
        line = next(ln for ln in listing.stdout.splitlines() if ln.startswith("cache-0 "))
        assert str(cache["pid"]) in line and "SIGKILL at" in line, listing.stdout
    finally:
        stop_up(proc)
    stopped = json.loads((tmp_path / ".switchboard" / "processes.json").read_text())
    assert not any(p["running"] for p in stopped["processes"])  # the table says the platform is down
