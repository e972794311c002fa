"""The Cluster page's table of what `switchboard up` supervises (control_plane/admin/processes.py): after an
incident the operator sees which process was restarted, how it died and when, even with no member left."""

from __future__ import annotations

import time

from control_plane.admin.processes import write_process_table
from tests.support.cluster import open_control_plane
from tests.support.console import texts


def test_cluster_page_shows_restarts_and_last_exits_from_ups_process_table(bare_console, tmp_path):
    table = tmp_path / "processes.json"
    now = time.time()
    write_process_table(table, 4242, [
        {"name": "cache-0", "pid": 111, "url": "http://127.0.0.1:1", "log": "logs/cache-0.log", "running": True,
         "started_at": now - 30, "restarts": 2, "last_exit_code": -9, "last_exit_at": now - 31},
        {"name": "shard-0", "pid": 112, "url": "http://127.0.0.1:2", "log": "logs/shard-0.log", "running": False,
         "started_at": now - 600, "restarts": 0, "last_exit_code": 1, "last_exit_at": now - 5},
    ], now)
    with open_control_plane("--processes-file", str(table)) as cp:
        bare_console.point_at(cp.url)
        at = bare_console.page("cluster")
        assert "Processes (switchboard up)" in texts(at)
        frame = next(d.value for d in at.dataframe if "process" in d.value.columns)
        rows = {r["process"]: r for r in frame.to_dict("records")}
        assert rows["cache-0"]["restarts"] == 2 and rows["cache-0"]["last_exit"].startswith("SIGKILL, 3")
        assert rows["cache-0"]["status"] == "running" and rows["cache-0"]["pid"] == 111
        assert rows["shard-0"]["status"] == "down" and rows["shard-0"]["last_exit"].startswith("exit code 1, ")


def test_a_process_killed_by_a_realtime_signal_is_shown_not_a_crash() -> None:
    """signal.valid_signals() holds the real-time signals (SIGRTMIN+n), which have no Signals member:
    the page raised ValueError for a process killed by one."""
    from admin_ui.views.cluster import processes_frame

    now = time.time()
    frame = processes_frame({"processes": [{"name": "shard-0", "pid": 1, "running": False, "restarts": 1,
                                            "last_exit_code": -40, "last_exit_at": now - 2}]}, now=now)
    assert list(frame["last_exit"]) == ["signal 40, 2 s ago"]


def test_a_process_up_killed_as_hung_says_so_on_the_page_and_in_admin_processes() -> None:
    """A shard `up` killed for not answering its health path showed "SIGKILL" alone, as the OOM killer's or an
    operator's kill -9 would: the reason the supervisor records is shown beside the signal."""
    from admin_ui.cli import format_processes
    from admin_ui.views.cluster import processes_frame

    now = time.time()
    reason = "hung: killed by up after 36 s without an answer on /health"
    table = {"processes": [{"name": "shard-0", "pid": 7, "running": True, "started_at": now - 10, "restarts": 1,
                            "last_exit_code": -9, "last_exit_at": now - 11, "last_exit_reason": reason},
                           {"name": "cache-0", "pid": 8, "running": True, "started_at": now - 10, "restarts": 1,
                            "last_exit_code": -9, "last_exit_at": now - 11, "last_exit_reason": None}]}
    frame = processes_frame(table, now=now)
    assert list(frame["last_exit"]) == [f"SIGKILL ({reason}), 11 s ago", "SIGKILL, 11 s ago"]
    lines = format_processes(table, now=now).splitlines()
    assert f"SIGKILL ({reason}) at " in lines[1] and "SIGKILL at " in lines[2], lines
