"""`switchboard up`'s restart backoff (control_plane/supervisor.py) on real child processes: it grows while a
child dies soon after each start (a crash loop) and starts over once a child had been running a while
(it used to count every death of the launcher's lifetime: a gateway killed for the fifth time, each after
hours of service, stayed down 30 s)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from control_plane import supervisor
from control_plane.supervisor import Child, Supervisor

BACKOFF = (0.05, 0.1, 0.2, 0.4)
STABLE_S = 1.0


def _death_noticed(sup: Supervisor, child: Child) -> float:
    """Kill the child, let the supervisor notice; the delay it chose before the restart."""
    assert child.proc is not None
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(5)
    before = time.monotonic()
    sup._restart_dead()
    assert child.next_restart > 0.0, "the death was not noticed"
    return child.next_restart - before


def _restarted(sup: Supervisor, child: Child) -> None:
    deadline = time.monotonic() + 5
    while not child.alive():
        assert time.monotonic() < deadline, "not restarted"
        time.sleep(0.02)
        sup._restart_dead()


def test_backoff_grows_in_a_crash_loop_and_starts_over_after_a_stable_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", BACKOFF)
    monkeypatch.setattr(supervisor, "RESTART_STABLE_S", STABLE_S, raising=False)
    child = Child("sleeper", [], "http://127.0.0.1:9", tmp_path / "sleeper.log",
                  command=[sys.executable, "-c", "import time; time.sleep(60)"])
    sup = Supervisor([child])
    child.start()
    try:
        loop = []
        for _ in range(3):  # each death right after its start: the backoff grows
            loop.append(_death_noticed(sup, child))
            _restarted(sup, child)
        assert [round(d, 2) for d in loop] == [0.05, 0.1, 0.2], loop
        time.sleep(STABLE_S + 0.2)  # then it runs a while: its next death is not part of the loop
        assert _death_noticed(sup, child) == pytest.approx(BACKOFF[0], abs=0.02)
        _restarted(sup, child)
        assert _death_noticed(sup, child) == pytest.approx(BACKOFF[1], abs=0.02)  # and a new loop grows again
        assert child.restarts == 4
    finally:
        child.stop(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait(5)


def test_the_process_table_shows_each_child_running_from_its_start(tmp_path: Path) -> None:
    """During `up`'s start-up (minutes while a model loads) the table said every child was down, pid none:
    it was written before any start and next before the banner (SwitchboardProcessNotRunning paged)."""
    import json

    (tmp_path / "logs").mkdir()
    kids = [Child(n, [], "http://127.0.0.1:1", tmp_path / "logs" / f"{n}.log", command=["sleep", "30"])
            for n in ("control-plane", "shard-0")]
    sup = Supervisor(kids, None, tmp_path / "logs", tmp_path / "processes.json")
    sup.guard()
    try:
        for k in kids:
            sup.start(k)
        rows = json.loads((tmp_path / "processes.json").read_text())["processes"]
        assert [(r["pid"], r["running"]) for r in rows] == [(k.proc.pid, True) for k in kids if k.proc], rows
    finally:
        sup.shutdown()
