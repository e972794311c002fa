"""How a server that cannot start says so: one line and exit 1.

A port another process holds was uvicorn's ERROR line among the startup's and exit code 3, after a shard had
loaded its model and a member had registered (now bound before the lifespan: data_plane/common/http_server.py
listen_socket); a --state-dir that cannot be made was mkdir's traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

from tests.support.cluster import ADMIN_TOKEN, open_control_plane
from tests.support.procs import ROOT, free_port


@pytest.mark.parametrize(("command", "args"), [
    ("cache-node", ["--node-id", "cache-held"]),
    ("shard", ["--engine", "synthetic", "--node-id", "shard-held"]),
])
def test_a_port_in_use_is_one_line_and_nothing_registers(command: str, args: list[str], tmp_path) -> None:
    with socket.socket() as held, open_control_plane(log_path=tmp_path / "cp.log").start() as cp:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ran = subprocess.run([sys.executable, "-m", "control_plane.cli", command, "--port", str(port),
                              "--registry-url", cp.url, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, check=False,
                             env={"PATH": "/usr/bin:/bin"})
        assert ran.returncode == 1, ran.stderr
        lines = [ln for ln in ran.stderr.splitlines() if " WARNING " not in ln and " INFO " not in ln]
        assert lines == [(f"switchboard {command}: cannot listen on 127.0.0.1:{port}: Address already in use "
                          "(another process holds it: stop it, or give this one another --port)")], ran.stderr
        assert "Traceback" not in ran.stderr and "ERROR" not in ran.stderr
        members = httpx.get(cp.url + "/admin/v1/members", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert not any(m["id"].endswith("-held") for m in members["members"]), members


@pytest.mark.parametrize("command", ["gateway", "control-plane"])
def test_a_state_dir_that_cannot_be_made_is_one_line(command: str, tmp_path) -> None:
    """`--state-dir` under a file (a read-only disk, another user's folder) ended in mkdir's traceback."""
    (tmp_path / "afile").write_text("")
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n- key: sk-test-startup-0001\n  tenant: t\n  tier: free\n")
    extra = ["--keys-file", str(keys), "--cache-urls", "http://127.0.0.1:1"] if command == "gateway" else []
    ran = subprocess.run([sys.executable, "-m", "control_plane.cli", command, "--port", "1", "--state-dir",
                          str(tmp_path / "afile" / "state"), *extra], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False, env={"PATH": "/usr/bin:/bin"})
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    assert ran.stderr.strip().splitlines()[-1].startswith(f"switchboard {command}: {tmp_path / 'afile'}/"), ran.stderr
    assert ran.stderr.strip().endswith(": Not a directory"), ran.stderr


@pytest.mark.parametrize("command", ["up", "cache-node"])
def test_a_redis_url_redis_py_cannot_read_is_one_line(command: str, tmp_path) -> None:
    """`up --redis localhost:6379` (no scheme) started everything, then showed the cache node's 20-line
    traceback from redis-py's from_url and stopped."""
    safe = ["--engine", "synthetic", "--no-console", "--shards", "1", "--cache-nodes", "1", "--gateway-port",
            str(free_port()), "--control-plane-port", str(free_port())] if command == "up" else []  # were it to start
    ran = subprocess.run([sys.executable, "-m", "control_plane.cli", command, "--redis", "localhost:6379", *safe],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert ran.stderr.strip().splitlines() == [
        f"switchboard {command}: --redis: String should match pattern '^(redis|rediss|unix)://'"], ran.stderr
    assert "starting control plane" not in ran.stdout and not list(tmp_path.iterdir())


def test_a_host_name_binds_ipv4_as_uvicorn_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """Binding before the lifespan took the resolver's first address: "localhost" is ::1 first on hosts with IPv6,
    so `--host localhost` listened on ::1 alone and clients of 127.0.0.1 were refused (uvicorn binds IPv4 for any
    host without a colon)."""
    from data_plane.common import http_server

    resolve = socket.getaddrinfo

    def ipv6_first(host: str, port: int, family: int = 0, type: int = 0, *rest: object) -> list[tuple]:
        found = resolve(host, port, family, type)
        if host == "localhost" and family in (0, socket.AF_UNSPEC):  # as glibc orders it with IPv6 configured
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)), *found]
        return found

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    try:
        sock = http_server.listen_socket("localhost", 0)
    except SystemExit as exc:  # this host has no ::1 to bind
        raise AssertionError(f"bound ::1, not 127.0.0.1: {exc}") from None
    with sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"
