"""`switchboard up`'s restart backoff (control_plane/supervisor.py) on real child processes: it grows while a
child dies soon after each start (a crash loop) and starts over once a child had been running a while
(it used to count every death of the launcher's lifetime: a gateway killed for the fifth time, each after
hours of service, stayed down 30 s)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from control_plane import supervisor
from control_plane.supervisor import Child, Supervisor
from tests.support.procs import free_port

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


def _supervise_until(sup: Supervisor, done: Callable[[], bool], timeout: float = 10.0) -> None:
    """What `Supervisor.run()` does each pass (without its signal handlers), until `done()`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the supervisor did not get there"
        sup._restart_dead()
        sup._kill_hung()
        time.sleep(0.05)


def test_a_hung_child_is_killed_and_restarted_one_still_loading_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOPped (or deadlocked) shard or cache node stayed frozen for good: the supervisor only noticed
    deaths, so it left membership ("shards 1/1 passing" of the 2 started), the process table said
    "running", and the free-tier sessions on a frozen cache node answered 404 until someone killed it."""
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.05,))
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(supervisor, "LIVENESS_TIMEOUT_S", 1.0)
    port = free_port()
    server = Child("cache-0", [], f"http://127.0.0.1:{port}", tmp_path / "cache-0.log",  # any answer (a 404) is alive
                   command=[sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"])
    loading = Child("shard-0", [], f"http://127.0.0.1:{free_port()}", tmp_path / "shard-0.log",  # never answers yet
                    command=[sys.executable, "-c", "import time; time.sleep(60)"])
    sup = Supervisor([server, loading])
    for child in (server, loading):
        child.start()
    try:
        _supervise_until(sup, lambda: server.answered_at > 0.0)
        time.sleep(1.5)
        _supervise_until(sup, lambda: time.monotonic() - server.answered_at > 1.5, timeout=3)  # answering: kept
        assert server.restarts == 0 and server.alive()
        assert server.proc is not None
        frozen = server.proc
        frozen.send_signal(signal.SIGSTOP)
        _supervise_until(sup, lambda: server.restarts == 1 and server.answered_at > 0.0)
        assert frozen.poll() == -signal.SIGKILL and server.last_exit_code == -signal.SIGKILL
        # said as such: a bare SIGKILL read as the OOM killer's or a person's kill -9 in `admin processes`
        assert (server.last_exit_reason or "").startswith("hung: killed by up after "), server.last_exit_reason
        assert server.row()["last_exit_reason"] == server.last_exit_reason
        assert httpx.get(server.url + "/health", timeout=2).status_code == 404  # the new one serves
        assert loading.alive() and loading.restarts == 0, "a child that never answered was killed as hung"
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)  # a death the supervisor did not cause carries no reason of its own
        _supervise_until(sup, lambda: server.restarts == 2)
        assert server.last_exit_code == -signal.SIGKILL and server.last_exit_reason is None
    finally:
        for child in (server, loading):
            child.stop(signal.SIGKILL)
            if child.proc is not None:
                child.proc.wait(5)


def test_a_stopped_child_still_stops_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` stopped with a child frozen (SIGSTOP, `kill -STOP` by an operator, a debugger) waited the whole
    10 s for it and then SIGKILLed it: its SIGTERM stayed pending while it was stopped, so its shutdown (a
    cache node's last snapshot, a member's deregistration) never ran. It is continued after the SIGTERM now,
    as systemd does."""
    monkeypatch.setattr(supervisor, "STOP_WAIT_S", 5.0)
    ready = tmp_path / "ready"
    graceful = ("import pathlib, signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
                f"pathlib.Path({str(ready)!r}).touch()\n"
                "time.sleep(60)\n")
    child = Child("cache-0", [], "http://127.0.0.1:9", tmp_path / "cache-0.log", command=[sys.executable, "-c", graceful])
    sup = Supervisor([child])
    child.start()
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.02)
    assert child.proc is not None
    child.proc.send_signal(signal.SIGSTOP)
    sup.shutdown()
    assert child.proc.returncode == 0, "killed, not stopped: its SIGTERM handler never ran"


def test_one_slow_answer_after_up_itself_paused_is_not_a_hang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 30 s were counted from the child's last answer, so when `up` itself had not run for that long
    (Ctrl-Z then fg, a stalled host, a long pass of the loop), the first probe after it that missed its
    1 s (a gateway busy for a moment) SIGKILLed a child that had failed one probe: every stream it served
    cut. A hang is now LIVENESS_TIMEOUT_S of failed probes."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(supervisor, "LIVENESS_TIMEOUT_S", 1.0)
    port = free_port()
    gateway = Child("gateway", [], f"http://127.0.0.1:{port}", tmp_path / "gateway.log",
                    command=[sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"])
    sup = Supervisor([gateway])
    gateway.start()
    try:
        _supervise_until(sup, lambda: gateway.answered_at > 0.0)
        assert gateway.proc is not None
        gateway.answered_at -= 60.0  # up was stopped for a minute; the child went on serving
        gateway.next_probe = 0.0
        gateway.proc.send_signal(signal.SIGSTOP)  # and is slow for the one probe up makes as it resumes
        sup._kill_hung()
        gateway.proc.send_signal(signal.SIGCONT)
        assert gateway.alive(), "one failed probe after up's own pause killed the child"
        _supervise_until(sup, lambda: time.monotonic() - gateway.answered_at < 0.5)
        assert gateway.alive() and gateway.restarts == 0
    finally:
        gateway.stop(signal.SIGKILL)
        if gateway.proc is not None:
            gateway.proc.wait(5)


@pytest.mark.parametrize("tty", [False, True])
def test_a_restarted_console_gets_a_fresh_login_link_to_the_operator(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tty: bool) -> None:
    """`up` wrote the console's login link to STATE/console_login (or printed it); a console its supervisor
    restarted got a fresh code nobody was told: the file held a dead link and no link logged anyone in."""
    from control_plane.launcher import LOGIN_CODE_ENV, relink_console
    from control_plane.up_banner import LOGIN_LINK_FILE, save_login_link

    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.01,))
    script = f"import os, time; print(os.environ[{LOGIN_CODE_ENV!r}], flush=True); time.sleep(60)"
    child = Child("console", [], "http://127.0.0.1:8501", tmp_path / "console.log",
                  env={LOGIN_CODE_ENV: "first-code"}, command=[sys.executable, "-c", script])
    sup = Supervisor([child], before_restart=relink_console(tmp_path, tty))
    if not tty:
        save_login_link(tmp_path, "http://127.0.0.1:8501/?token=first-code")  # as the banner left it
    def printed(n: int) -> list[str]:  # the codes each run of the console got, as it printed them
        deadline = time.monotonic() + 10
        while len(found := child.log_path.read_text().split()) < n:
            assert time.monotonic() < deadline, found
            time.sleep(0.02)
        return found

    child.start()
    try:
        printed(1)
        _death_noticed(sup, child)
        _restarted(sup, child)
        codes = printed(2)
        assert codes[0] == "first-code" and codes[1] != "first-code"  # a spent code stays spent
        link = f"http://127.0.0.1:8501/?token={codes[1]}"  # what the restarted console accepts
        out = capsys.readouterr().out
        if tty:
            assert link in out and not (tmp_path / LOGIN_LINK_FILE).exists()
        else:
            assert codes[1] not in out and str(tmp_path / LOGIN_LINK_FILE) in out  # never in up.log
            assert (tmp_path / LOGIN_LINK_FILE).read_text() == link + "\n"
            assert (tmp_path / LOGIN_LINK_FILE).stat().st_mode & 0o777 == 0o600
    finally:
        child.stop(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait(5)
