"""Fixtures for the console's tests: a real cluster, and AppTest runs of one console page.

    def test_x(console):                      # env points the console at the session's cluster
        at = console.page("cluster")          # AppTest, main script run, then the page
        at.button(key="drain-shard-0").click().run()
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.procs import free_port

APP = str(Path(__file__).resolve().parents[2] / "admin_ui" / "app.py")
PAGES = ["overview", "cluster", "traffic", "autoscaler", "degradation", "traces", "alerts", "playground", "usage"]


@pytest.fixture(scope="session")
def cluster():
    """Control plane, 2 synthetic shards, 1 cache node, a gateway: real processes on loopback."""
    with Cluster(shards=2, caches=1) as c:
        yield c


@pytest.fixture(scope="session")
def admin(cluster):
    """The admin API, straight (to check what the console did)."""
    with httpx.Client(base_url=cluster.control_plane.url, timeout=5,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        yield http


class ConsoleRunner:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.monkeypatch = monkeypatch
        self.credentials = tmp_path / "credentials.json"
        monkeypatch.setenv("SWITCHBOARD_CREDENTIALS_FILE", str(self.credentials))
        monkeypatch.delenv("SWITCHBOARD_ADMIN_TOKEN", raising=False)

    def point_at(self, control_plane_url: str, *, token: str | None = ADMIN_TOKEN, gateway_url: str | None = None,
                 keys: dict[str, str] | None = None) -> None:
        self.monkeypatch.setenv("SWITCHBOARD_CONTROL_PLANE_URL", control_plane_url)
        self.monkeypatch.setenv("SWITCHBOARD_GATEWAY_URL", gateway_url or "http://127.0.0.1:9")
        if token is not None:
            self.monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", token)
        self.credentials.write_text(json.dumps({"keys": keys or {}}))

    def page(self, name: str, *, timeout: float = 30) -> AppTest:
        at = AppTest.from_file(APP, default_timeout=timeout)
        at.run()
        if name != "overview":
            at.switch_page(f"screens/{name}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        return at


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


def texts(at: AppTest) -> str:
    """Every piece of text the run produced (markdown, alerts, captions, metrics), for `in` checks."""
    parts = []
    for kind in ("markdown", "caption", "error", "warning", "info", "success", "title", "subheader", "header"):
        parts += [str(e.value) for e in getattr(at, kind)]
    parts += [f"{m.label}: {m.value}" for m in at.metric]
    return "\n".join(parts)


def require(admin: httpx.Client, path: str) -> None:
    """Skip the calling test if the control plane lacks `path` (an endpoint still being written)."""
    if admin.get(path).status_code in (404, 405):
        pytest.skip(f"{path} is not available on this control plane yet")
