"""Fixtures for the console's tests: a real cluster, and AppTest runs of one console page
(tests.support.console: ConsoleRunner, texts, require).

    def test_x(console):                      # env points the console at the session's cluster
        at = console.page("cluster")          # AppTest, main script run, then the page
        at.button(key="drain-shard-0").click().run()
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("streamlit")

from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.console import ConsoleRunner
from tests.support.procs import free_port


@pytest.fixture(scope="package")
def cluster():
    """Control plane, 2 synthetic shards, 1 cache node, a gateway: real processes on loopback. Package-scoped:
    as a session fixture it lived (and heartbeated, ~7 % of a core) until the whole suite ended."""
    with Cluster(shards=2, caches=1) as c:
        yield c


@pytest.fixture(scope="package")
def admin(cluster):
    """The admin API, straight (to check what the console did)."""
    with httpx.Client(base_url=cluster.control_plane.url, timeout=5,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        yield http


@pytest.fixture
def console(monkeypatch, tmp_path, cluster) -> ConsoleRunner:
    runner = ConsoleRunner(monkeypatch, tmp_path)
    keys = {t: cluster.keys[t] for t in ("free", "plus", "enterprise")}
    runner.point_at(cluster.control_plane.url, gateway_url=cluster.gateway.url, keys=keys)
    return runner


@pytest.fixture
def bare_console(monkeypatch, tmp_path) -> ConsoleRunner:
    """A console pointed at nothing yet (no cluster started)."""
    runner = ConsoleRunner(monkeypatch, tmp_path)
    runner.point_at(f"http://127.0.0.1:{free_port()}")
    return runner
