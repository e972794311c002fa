"""The children of `switchboard up` and their supervision: start, health wait, restart with backoff, stop.

    cp = Child("control-plane", ["control-plane", "--port", "8300"], "http://127.0.0.1:8300", logs / "cp.log")
    cp.start(); wait_healthy([cp], 30, "control plane")
    Supervisor([cp, *caches, *shards, gateway]).run()     # until Ctrl-C / SIGTERM; then stops in reverse

Used by the dev launcher (control_plane/launcher.py), which plans the children and prints the
banner. A child is ``python -m control_plane.cli ARGS`` unless it names its own ``command``
(prometheus); its output goes to its log file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds before restarting a child that died, by how often it has (the last one repeats)."""


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

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 -- the child writes to it for its whole life
        self.proc = subprocess.Popen(
            self.command or [sys.executable, "-m", "control_plane.cli", *self.args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
            start_new_session=True,  # we deliver signals ourselves, in order
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)


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


class Supervisor:
    """Restarts a child that died (with backoff) until SIGINT/SIGTERM, then stops them all in reverse order."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.stopping = False

    def run(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        while not self.stopping:
            now = time.monotonic()
            for child in self.children:
                if self.stopping or child.alive():
                    continue
                if child.next_restart == 0.0:
                    code = child.proc.returncode if child.proc else None
                    delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                    print(f"[switchboard] {child.name} exited (code {code}); restarting in {delay:.0f} s "
                          f"(log: {child.log_path})", flush=True)
                    child.next_restart = now + delay
                elif now >= child.next_restart:
                    child.restarts += 1
                    child.next_restart = 0.0
                    child.start()
                    print(f"[switchboard] {child.name} restarted (restart #{child.restarts})", flush=True)
            time.sleep(0.5)
        self.shutdown()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        print("\n[switchboard] stopping...", flush=True)
        # Front door first, so no new work arrives; registry last, so members can deregister.
        for child in reversed(self.children):
            child.stop()
            if child.proc is not None:
                try:
                    child.proc.wait(10)
                except subprocess.TimeoutExpired:
                    child.stop(signal.SIGKILL)
        print("[switchboard] stopped.", flush=True)


__all__ = ["RESTART_BACKOFF_S", "Child", "Supervisor", "tail", "wait_healthy"]
