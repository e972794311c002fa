"""The children of `switchboard up` and their supervision: start, health wait, restart with backoff, stop.

    cp = Child("control-plane", ["control-plane", "--port", "8300"], "http://127.0.0.1:8300", logs / "cp.log")
    cp.start(); wait_healthy([cp], 30, "control plane")
    supervisor = Supervisor([cp, *caches, *shards, gateway])
    supervisor.guard()        # from here a SIGTERM/SIGINT/SIGHUP raises Stopped: start-up unwinds, shutdown() runs
    ...start them...
    supervisor.run()          # until Ctrl-C / SIGTERM; then stops in reverse

Used by the dev launcher (control_plane/launcher.py), which plans the children and prints the
banner. A child is ``python -m control_plane.cli ARGS`` unless it names its own ``command``
(prometheus); its output goes to its log file.

No orphans: every child is started with a parent-death signal (data_plane/common/lifeline.py), so
whatever stops the launcher (kill -9, a crash, a signal at any moment) takes its children with it
within moments; an orderly stop (a signal once `guard()` ran) stops them in reverse order, and a
second signal during that stop kills what is left at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from control_plane.admin.processes import write_process_table
from control_plane.state_dir import LogRotation
from data_plane.common.lifeline import die_with_parent

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds before restarting a child that died, by how often it has in a row (the last one repeats)."""
RESTART_STABLE_S = 60.0
"""A child that ran this long before dying starts the backoff again at its first step: the backoff is
for crash loops. Counted over its lifetime instead, a gateway killed for the fifth time in a day (each
time after hours of service) stayed down 30 s, the whole chat API with it (systemd and Kubernetes reset
their backoff the same way)."""
LIVENESS_PERIOD_S = 5.0
"""Seconds between two liveness probes of a running child (its health path, any HTTP answer counts)."""
LIVENESS_PROBE_TIMEOUT_S = 1.0
"""Seconds one probe waits for an answer."""
LIVENESS_TIMEOUT_S = 30.0
"""A child that answered once since its start and then nothing for this long is hung (a deadlock, a
SIGSTOP, a host that stopped scheduling it): it is killed, and restarted as a dead one is. Without it, a
frozen shard or cache node stayed frozen for good: out of membership (so `switchboard admin status` said
"shards 1/1 passing" of the 2 started, the process table "running"), its free-tier sessions answered 404
until someone found it and killed it by hand (Kubernetes' liveness probe, systemd's watchdog)."""


@dataclass
class Child:
    """One process of the platform: how to start it, where it logs, where it answers health."""

    name: str
    args: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    health: str = "/health"
    command: list[str] | None = None
    """A foreign program (e.g. prometheus); default: `python -m control_plane.cli ARGS`."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_restart: float = 0.0
    crashes: int = 0
    """Deaths in a row, each within RESTART_STABLE_S of its start: the backoff step."""
    started_at: float = 0.0
    started_wall: float = 0.0
    last_exit_code: int | None = None
    """How its last run ended (a negative code: the signal that killed it), None before any death."""
    last_exit_at: float | None = None
    last_exit_reason: str | None = None
    """Why the supervisor itself killed its last run ("hung: ..."), None when it died on its own: a SIGKILL
    from the liveness check must not read as the OOM killer's or an operator's kill -9."""
    kill_reason: str | None = None
    """Set when the supervisor kills the current run (a hang), moved to `last_exit_reason` at its death."""
    answered_at: float = 0.0
    """When its health path last answered (monotonic; 0.0: not since its start, so not yet probed for liveness)."""
    next_probe: float = 0.0
    failing_since: float = 0.0
    """When the probes after its last answer began to fail (monotonic; 0.0: the last one was answered)."""

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.answered_at = self.next_probe = self.failing_since = 0.0
        self.kill_reason = None
        self.started_wall = time.time()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command or [sys.executable, "-m", "control_plane.cli", *self.args],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True,  # we deliver signals ourselves, in order
                # and if we cannot (kill -9, a crash), the kernel does; the launcher has one thread
                preexec_fn=die_with_parent(),  # noqa: PLW1509
            )

    def row(self) -> dict[str, object]:
        """Its line of the process table (control_plane/admin/processes.py)."""
        return {"name": self.name, "pid": self.proc.pid if self.proc else None, "url": self.url,
                "log": str(self.log_path), "running": self.alive(), "started_at": self.started_wall or None,
                "restarts": self.restarts, "last_exit_code": self.last_exit_code, "last_exit_at": self.last_exit_at,
                "last_exit_reason": self.last_exit_reason}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            if sig != signal.SIGKILL:  # a stopped (SIGSTOP) child handles its SIGTERM only once continued
                self.proc.send_signal(signal.SIGCONT)


def wait_healthy(children: list[Child], timeout: float, what: str) -> None:
    """Wait until every child answers its health path; exit naming the first one that died or hung."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending and time.monotonic() < deadline:
        for child in list(pending):
            if not child.alive():
                raise SystemExit(f"switchboard up: {child.name} exited during start-up; see {child.log_path}:\n"
                                 + tail(child.log_path))
            try:
                if httpx.get(child.url + child.health, timeout=1.0).status_code == 200:
                    pending.remove(child)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    if pending:
        raise SystemExit(f"switchboard up: {', '.join(c.name for c in pending)} not healthy after {timeout:.0f} s "
                         f"({what}); see {pending[0].log_path}:\n" + tail(pending[0].log_path))


def tail(path: Path, n: int = 1500) -> str:
    """The end of a child's log, for an error message."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops the platform: Ctrl-C, a service manager's stop, the terminal closing."""

STOP_WAIT_S = 10.0
"""Seconds a child is given to stop after SIGTERM before SIGKILL."""


class Stopped(BaseException):
    """A stop signal arrived during start-up (raised from the handler, so the start-up unwinds)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Supervisor:
    """Restarts a child that died (with backoff) until SIGINT/SIGTERM, then stops them all in reverse order."""

    def __init__(self, children: list[Child], log_rotation: LogRotation | None = None,
                 log_dir: Path | None = None, table: Path | None = None,
                 before_restart: Callable[[Child], None] | None = None) -> None:
        self.children = children
        self.before_restart = before_restart
        """Called with a child about to be restarted (not at its first start), e.g. to give the console a fresh
        login code and hand its new link to the operator (control_plane/launcher.py); an error is printed,
        and the child restarted regardless."""
        self.table = table
        """Where each start, death and restart is recorded for operators (STATE_DIR/processes.json)."""
        self.log_rotation = log_rotation
        """Caps the ``*.log`` files of `log_dir` (the children's, the autoscaled shards') as `run()` goes."""
        self.log_dir = log_dir
        self.stopping = False
        self._running = False
        self._shutting_down = False
        self._stopped = False
        self._force = False

    def guard(self) -> None:
        """Handle the stop signals from now on: during start-up they raise `Stopped` (the caller's
        ``except BaseException: shutdown()`` runs), while `run()` they end the loop."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        if not self._running:
            self.record()  # no longer the last run's table: its pids are gone

    def start(self, child: Child) -> None:
        """Start `child` (at start-up and each restart) and record it at once: at start-up the table said
        it was down, pid none, until the banner (minutes while a model loads), so
        SwitchboardProcessNotRunning paged on a slow start."""
        child.start()
        self.record()

    def run(self) -> None:
        self.guard()
        self._running = True
        self.record()
        try:
            while not self.stopping:
                self._restart_dead()
                self._kill_hung()
                self._rotate_logs()
                time.sleep(0.5)
        finally:
            self.shutdown()

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if self.stopping or child.alive():
                continue
            if child.next_restart == 0.0:
                code = child.proc.returncode if child.proc else None
                if now - child.started_at >= RESTART_STABLE_S:
                    child.crashes = 0
                delay = RESTART_BACKOFF_S[min(child.crashes, len(RESTART_BACKOFF_S) - 1)]
                child.crashes += 1
                child.last_exit_code, child.last_exit_at = code, time.time()
                child.last_exit_reason, child.kill_reason = child.kill_reason, None
                self.record()
                why = f", {child.last_exit_reason}" if child.last_exit_reason else ""
                print(f"[switchboard] {child.name} exited (code {code}{why}); restarting in {delay:.0f} s "
                      f"(log: {child.log_path})", flush=True)
                child.next_restart = now + delay
            elif now >= child.next_restart:
                child.restarts += 1
                child.next_restart = 0.0
                if self.before_restart is not None:
                    try:
                        self.before_restart(child)
                    except OSError as exc:  # e.g. a full disk: it must not stop the supervision of every child
                        print(f"[switchboard] {child.name}: before its restart: {exc!r}", flush=True)
                self.start(child)
                print(f"[switchboard] {child.name} restarted (restart #{child.restarts})", flush=True)

    def _kill_hung(self) -> None:
        """Probe each running child's health path every LIVENESS_PERIOD_S; SIGKILL one that answered once
        and then no probe for LIVENESS_TIMEOUT_S (`_restart_dead` restarts it). Any HTTP status is an
        answer: a gateway with no shard left says 503 and is alive. Before its first answer a child is
        loading (a model, minutes): that is start-up, not a hang."""
        for child in self.children:
            now = time.monotonic()
            if self.stopping or not child.alive() or now < child.next_probe:
                continue
            child.next_probe = now + LIVENESS_PERIOD_S
            try:
                httpx.get(child.url + child.health, timeout=LIVENESS_PROBE_TIMEOUT_S)
                child.answered_at, child.failing_since = time.monotonic(), 0.0
            except httpx.HTTPError:
                if not child.answered_at:
                    continue
                # Counted from the first probe that failed, not from the last answer: after a pause of up
                # itself (Ctrl-Z, a stalled host, a slow pass), one slow answer is not 30 s of silence.
                child.failing_since = child.failing_since or now
                if now - child.failing_since >= LIVENESS_TIMEOUT_S:
                    silent = now - child.answered_at
                    print(f"[switchboard] {child.name} has not answered {child.health} for "
                          f"{silent:.0f} s (hung); killing it (log: {child.log_path})", flush=True)
                    child.kill_reason = f"hung: killed by up after {silent:.0f} s without an answer on {child.health}"
                    child.stop(signal.SIGKILL)

    def record(self) -> None:
        """Write the process table now (each start, death and restart does, and `run()` as it begins)."""
        if self.table is not None:
            try:
                write_process_table(self.table, os.getpid(), [c.row() for c in self.children], time.time())
            except OSError as exc:  # a full disk must not stop the supervision
                print(f"[switchboard] could not write {self.table}: {exc}", flush=True)

    def _rotate_logs(self) -> None:
        if self.log_rotation is not None and self.log_dir is not None:
            self.log_rotation.rotate_full(self.log_dir)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._shutting_down:  # a second signal while stopping: no more waiting
            self._force = True
            return
        self.stopping = True
        if not self._running:
            raise Stopped(signum)

    def shutdown(self) -> None:
        """Stop every child (once; later calls return at once)."""
        if self._shutting_down or self._stopped:
            return
        self._shutting_down = True
        self.stopping = True
        print("\n[switchboard] stopping... (a second Ctrl-C kills what is left)", flush=True)
        # Front door first, so no new work arrives; registry last, so members can deregister.
        for child in reversed(self.children):
            if self._force:
                break
            child.stop()
            deadline = time.monotonic() + STOP_WAIT_S
            while child.alive() and not self._force and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.alive():
                child.stop(signal.SIGKILL)
        for child in self.children:  # forced, or a child that ignored SIGTERM: kill, then reap
            child.stop(signal.SIGKILL)
            if child.proc is not None:
                try:
                    child.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        self._stopped = True
        self.record()
        print("[switchboard] stopped.", flush=True)


__all__ = ["LIVENESS_PROBE_TIMEOUT_S", "LIVENESS_TIMEOUT_S", "RESTART_BACKOFF_S", "STOP_SIGNALS", "Child", "Stopped", "Supervisor", "tail", "wait_healthy"]
