"""No orphans (issue 28 part 5): whatever stops `switchboard up` (SIGTERM during start-up or after it,
a second signal during shutdown, kill -9 of the launcher) and whatever kills the autoscaler's control
plane, no child outlives its parent for more than a few seconds, and the ports are free again.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/control_plane/test_orphans.py -x -q
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.support.procs import free_port, start_up, wait_up

GONE_WITHIN_S = 5.0
"""'No child outlives it for more than a few seconds.'"""


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _descendants(root: int) -> dict[int, str]:
    """Every live process below `root` (any depth), with its command line."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (ppid := _ppid(int(entry.name))) is not None:
            parents[int(entry.name)] = ppid
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = _cmdline(pid)
                frontier.append(pid)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int, cmdline: str) -> bool:
    """Still running as the same program (not a zombie, not a reused pid)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status.lower() and _cmdline(pid) == cmdline


def _ports(cmdlines: dict[int, str]) -> list[int]:
    ports = []
    for line in cmdlines.values():
        words = line.split()
        ports += [int(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--port"]
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _assert_all_gone(seen: dict[int, str], within: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while (alive := {p: c for p, c in seen.items() if _alive(p, c)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"outlived their parent by {within:.0f} s: {alive}"
    deadline = time.monotonic() + 2.0  # a killed process's sockets close a moment after it is gone
    while (busy := [p for p in _ports(seen) if not _port_free(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not busy, f"ports still bound: {busy}"


def _kill_all(seen: dict[int, str]) -> None:
    for pid, cmd in seen.items():
        if _alive(pid, cmd):
            os.kill(pid, signal.SIGKILL)


def _up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    cp = free_port()
    proc = start_up(tmp_path, "--engine", "synthetic", "--gateway-port", str(free_port()), "--control-plane-port",
                    str(cp), "--no-console", "--cache-nodes", "1", *extra)
    return proc, cp


def _watch(proc: subprocess.Popen[bytes], seen: dict[int, str], until: float, want: int) -> None:
    """Record proc's descendants until at least `want` are seen (or `until`)."""
    while time.monotonic() < until and len(seen) < want:
        assert proc.poll() is None, "the launcher exited early"
        seen.update(_descendants(proc.pid))
        time.sleep(0.05)


def test_sigterm_during_start_up_stops_what_was_started(tmp_path: Path) -> None:
    proc, _ = _up(tmp_path, "--shards", "1")
    seen: dict[int, str] = {}
    try:
        # the control plane and the cache node run; the launcher is still waiting (no banner yet)
        _watch(proc, seen, time.monotonic() + 60, want=2)
        assert b"Switchboard is up" not in (tmp_path / "up.log").read_bytes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) != 0
        assert "stopped by SIGTERM during start-up" in (tmp_path / "up.log").read_text()
        _assert_all_gone(seen, within=1.0)  # stopped in order, not left to the kernel
    finally:
        proc.kill()
        _kill_all(seen)


def test_sigterm_after_start_up_stops_everything(tmp_path: Path) -> None:
    proc, _ = _up(tmp_path, "--shards", "1")
    seen: dict[int, str] = {}
    try:
        wait_up(proc, tmp_path, 120)
        seen.update(_descendants(proc.pid))
        assert len(seen) >= 4, seen  # control plane, cache node, shard, gateway
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _assert_all_gone(seen, within=1.0)
    finally:
        proc.kill()
        _kill_all(seen)


def test_a_second_signal_during_shutdown_kills_what_is_left(tmp_path: Path) -> None:
    proc, _ = _up(tmp_path, "--shards", "1")
    seen: dict[int, str] = {}
    try:
        wait_up(proc, tmp_path, 120)
        seen.update(_descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        _assert_all_gone(seen, within=1.0)
    finally:
        proc.kill()
        _kill_all(seen)


def test_kill_9_of_the_launcher_takes_its_children_and_the_autoscalers_shards(tmp_path: Path) -> None:
    """kill -9 leaves nobody to stop anything: the control plane, cache node, gateway (parent-death
    signal from the launcher) and the shard the autoscaler started (from the control plane) go too."""
    proc, _ = _up(tmp_path, "--autoscale", "--min-replicas", "1", "--max-replicas", "2")
    seen: dict[int, str] = {}
    try:
        wait_up(proc, tmp_path, 120)
        seen.update(_descendants(proc.pid))
        assert any("shard-local-" in c for c in seen.values()), seen  # a grandchild: the actuator's shard
        proc.kill()
        proc.wait(10)
        _assert_all_gone(seen)
    finally:
        proc.kill()
        _kill_all(seen)


def test_the_actuators_shards_die_with_a_killed_control_plane(tmp_path: Path) -> None:
    proc, _ = _up(tmp_path, "--autoscale", "--min-replicas", "1", "--max-replicas", "2")
    seen: dict[int, str] = {}
    try:
        wait_up(proc, tmp_path, 120)
        seen.update(_descendants(proc.pid))
        cp = next(p for p, c in seen.items() if " control-plane " in c)
        shards = {p: c for p, c in seen.items() if "shard-local-" in c and _ppid(p) == cp}
        assert shards, seen
        os.kill(cp, signal.SIGKILL)
        _assert_all_gone(shards)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        seen.update(_descendants(proc.pid))
    finally:
        proc.kill()
        _kill_all(seen)


def test_die_with_parent_covers_any_program(tmp_path: Path) -> None:
    """The net itself: a parent that dies by SIGKILL takes a foreign child (sleep) along."""
    script = textwrap.dedent("""
        import subprocess, sys, time
        from data_plane.common.lifeline import die_with_parent
        child = subprocess.Popen(["sleep", "300"], preexec_fn=die_with_parent(), start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    cmd = _cmdline(child)
    try:
        assert _alive(child, cmd)
        parent.kill()
        parent.wait(5)
        _assert_all_gone({child: cmd}, within=2.0)
    finally:
        parent.kill()
        _kill_all({child: cmd})
