"""Real processes on loopback for tests: start, wait for /health, stop.

    with Service(["shard", "--engine", "synthetic"]) as shard:
        httpx.get(shard.url + "/health")

Each service runs `python -m control_plane.cli ARGS --port P` on a free loopback port;
its output goes to a log file whose tail is shown if it fails to come up.

Under pytest-xdist (`make test` runs `-n 2`) each worker hands out ports from its own range below the
kernel's ephemeral range (so two workers, and the kernel's own bind(0) picks, never meet) and its
services keep their state (the usage ledger) in a folder of their own, STATE_DIR.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import httpx

from tests.support.forkserver import ForkedProcess, ForkServer

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (children run there)."""


CLUSTER_TOKEN = "test-cluster-token"
CLUSTER_HEADERS = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}
"""What a test sends to a spawned member's internal routes (/debug/spans, a cache node's sessions)."""
METRICS_TOKEN = "test-metrics-token"
METRICS_HEADERS = {"Authorization": f"Bearer {METRICS_TOKEN}"}
"""What a test scrapes a spawned process's /metrics with (tests/support/metrics.py `scrape`, and the
test Prometheus): the read-only token, as a production Prometheus would hold it."""


WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
"""This pytest-xdist worker's name ("gw0", "gw1", ...), or "" in a plain pytest run."""

STATE_DIR = ROOT / ".switchboard" / WORKER if WORKER else ROOT / ".switchboard"
"""Where the gateways and control planes a Service starts keep their usage ledger (their own default,
`.switchboard` in ROOT, in a plain run; a folder per xdist worker, so one worker's traffic never shows in
another's usage totals or abuse readings)."""

_GIVEN: set[int] = set()
"""Ports handed out by this test process: never twice. Services are built (ports chosen) before any
starts, and the kernel may hand the same free port to two bind(0) calls in a row; two children on
one port make the loser exit and its health check succeed against the winner."""

_LOWEST_PORT = 10000


def _worker_ports() -> range | None:
    """This xdist worker's share of [10000, the ephemeral range's start): bind(0) picks ports from the
    ephemeral range in every process, so two workers probing it could be handed the same port between one's
    probe and its child's bind. None outside xdist (or where the shares would be too small)."""
    if not (WORKER.startswith("gw") and WORKER[2:].isdigit()):
        return None
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    size = (low - _LOWEST_PORT) // count
    if size < 500:
        return None
    first = _LOWEST_PORT + int(WORKER[2:]) % count * size
    return range(first, first + size)


if WORKER:
    STATE_DIR.mkdir(parents=True, exist_ok=True)


_PORTS = _worker_ports()
_STRIDE = 97
"""The walk through the range takes every 97th port (a prime: every port once a lap), never the next one:
a test that takes p and counts on p + 1 (`switchboard up --zones` puts zone b's gateway there) must not
see its next free_port() hand out p + 1."""
while _PORTS is not None and len(_PORTS) % _STRIDE == 0:
    _STRIDE += 2
_next = random.randrange(len(_PORTS)) if _PORTS is not None else 0
"""Where this worker's walk starts: anywhere, so two suites run at once on one host (each with its own gw0)
do not walk the same ports in step."""
_walked = 0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing listens on, never handed out twice by this process (see _worker_ports)."""
    global _next, _walked
    if _PORTS is not None:
        for _ in range(len(_PORTS)):
            port = _PORTS[_next]
            _next = (_next + _STRIDE) % len(_PORTS)
            _walked += 1
            if _walked % len(_PORTS) == 0:
                _GIVEN.clear()  # a full lap: the ports of the first services are long free again
            if port not in _GIVEN and _bindable(port):
                _GIVEN.add(port)
                return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def free_port_pair() -> int:
    """A port p, with p + 1 free too (`switchboard up --zones a,b` puts zone b's gateway there); both are
    taken out of what :func:`free_port` hands out."""
    for _ in range(50):
        p = free_port()
        if p + 1 not in _GIVEN and _bindable(p + 1):
            _GIVEN.add(p + 1)
            return p
    raise RuntimeError("no two consecutive free ports")


class Service:
    """`python -m MODULE ARGS --port P` (MODULE: the `switchboard` CLI unless given) as a child process.

    It gets the cluster token and the metrics token unless `isolated` (then it also drops the pytest
    process's SWITCHBOARD_* variables: a registry in the open mode, /metrics open). Restart one on the same port by building
    a new Service with `port=old.port`.
    """

    def __init__(self, args: list[str], *, port: int | None = None, ready_timeout: float = 90.0,
                 env: dict[str, str] | None = None, health: str = "/health", module: str = "control_plane.cli",
                 isolated: bool = False, log_path: Path | None = None) -> None:
        self.port = port or free_port()
        self.args = [sys.executable, "-m", module, *args, "--port", str(self.port)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        # Every spawned control plane requires it, every spawned member presents it (the pytest
        # process itself stays without one, so in-process apps run in the open mode).
        if isolated:
            base = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        else:
            base = {**os.environ, "SWITCHBOARD_CLUSTER_TOKEN": CLUSTER_TOKEN, "SWITCHBOARD_METRICS_TOKEN": METRICS_TOKEN}
        if WORKER:  # the gateway's and the control plane's default ledger, per worker (flags still win)
            base.setdefault("SWITCHBOARD_GATEWAY_STATE_DIR", str(STATE_DIR))
            base.setdefault("SWITCHBOARD_CONTROL_PLANE_USAGE_DB", f"sqlite:///{STATE_DIR / 'usage.db'}")
        self.env = {**base, **(env or {})}
        self.health = health
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="sb-test-", suffix=".log")[1])

    def start(self, wait: bool = True) -> Self:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 -- the process writes to it until stop()
        # `python -m MODULE ...` is forked; a command wrapped in another (`ip netns exec ...`) is not
        server = ForkServer.shared(ROOT) if self.args[:2] == [sys.executable, "-m"] else None
        forked = server and server.spawn(self.args[2], self.args[3:], env=self.env, cwd=ROOT, log=self._log.fileno())
        self.proc = forked or subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                               env=self.env)
        if wait:
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_healthy(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.args} not healthy after {timeout or self.ready_timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9: no clean shutdown, no deregistration."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM without waiting (:func:`stop_all` signals several, then waits for each)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = self.proc

    def stop(self) -> int | None:
        """SIGTERM (unless :meth:`terminate` sent it), then kill -9 after 15 s; the exit code (None if it
        never started)."""
        if self.proc and self.proc.poll() is None and getattr(self, "_terminated", None) is not self.proc:
            self.proc.send_signal(signal.SIGTERM)
        if self.proc and self.proc.returncode is None:
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(services: list[Service]) -> None:
    """Stop several at once: SIGTERM to every one, then wait for each (kill -9 after 15 s). One after
    another, a cluster's five processes took ~0.3 s each to exit; signalled together they exit together."""
    for s in services:
        s.terminate()
    for s in services:
        s.stop()


def switchboard(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`switchboard ARGS` to completion, output captured (never raises on a non-zero exit)."""
    return subprocess.run([sys.executable, "-m", "control_plane.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)


def start_up(cwd: Path, *args: str) -> subprocess.Popen[bytes]:
    """`switchboard up ARGS` as a child process in `cwd`, its output in ``cwd/up.log``."""
    with open(cwd / "up.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "control_plane.cli", "up", *args], cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def stop_up(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    """Stop a `switchboard up` from :func:`start_up` as an operator would (Ctrl-C), killed after 60 s."""
    proc.send_signal(sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_up(proc: subprocess.Popen[bytes], cwd: Path, timeout: float = 90.0) -> str:
    """Until `switchboard up` (from :func:`start_up`) prints its banner; returns its output so far."""
    log_path = cwd / "up.log"
    deadline = time.monotonic() + timeout
    while b"Ctrl-C stops everything" not in log_path.read_bytes():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.3)
    return log_path.read_text()
