"""Running one console page in-process (Streamlit's AppTest) against a real cluster, for tests.

    runner = ConsoleRunner(monkeypatch, tmp_path)
    runner.point_at(cluster.control_plane.url, gateway_url=cluster.gateway.url, keys={...})
    at = runner.page("cluster")                 # main script run, log in, then the page; no exception raised
    assert "shards 2/2 passing" in texts(at)
    require(admin, "/admin/v1/signals")         # the endpoint a page reads answers 200 (else: fail)

Used by tests/admin_ui (its conftest builds the fixtures from these). Needs streamlit: the
importer skips without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

from admin_ui import login
from admin_ui.settings import ConsoleSettings
from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import ROOT

APP = str(ROOT / "admin_ui" / "app.py")
PAGES = ["overview", "cluster", "traffic", "autoscaler", "degradation", "traces", "alerts", "playground", "usage"]


class ConsoleRunner:
    """The console's environment (control plane, token, gateway, credentials file) set with
    `monkeypatch`, and AppTest runs of its pages."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.monkeypatch = monkeypatch
        self.credentials = tmp_path / "credentials.json"
        monkeypatch.setenv("SWITCHBOARD_CREDENTIALS_FILE", str(self.credentials))
        monkeypatch.delenv("SWITCHBOARD_ADMIN_TOKEN", raising=False)
        monkeypatch.setattr(login, "GATE", login.Gate())  # no failed login of another test counts here

    def point_at(self, control_plane_url: str, *, token: str | None = ADMIN_TOKEN, gateway_url: str | None = None,
                 keys: dict[str, str] | None = None) -> None:
        self.monkeypatch.setenv("SWITCHBOARD_CONTROL_PLANE_URL", control_plane_url)
        self.monkeypatch.setenv("SWITCHBOARD_GATEWAY_URL", gateway_url or "http://127.0.0.1:9")
        if token is not None:
            self.monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", token)
        self.credentials.write_text(json.dumps({"keys": keys or {}}))

    def page(self, name: str, *, timeout: float = 30, log_in: bool = True) -> AppTest:
        """Run the console, log in with the token it reads (unless `log_in` is False), open page `name`."""
        at = AppTest.from_file(APP, default_timeout=timeout)
        at.run()
        if log_in:
            token = ConsoleSettings().admin_token_value()
            assert token, "the console under test has no admin token to log in with"
            login_with(at, token)
            assert not [w for w in at.text_input if w.key == "login-token"], f"still on the login page: {texts(at)}"
        if name != "overview":
            at.switch_page(f"screens/{name}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        return at


def login_with(at: AppTest, token: str) -> AppTest:
    """Type `token` into the login form and submit it (the console's login page must be showing)."""
    at.text_input(key="login-token").input(token)
    at.button(key="login-submit").click().run()
    return at


def texts(at: AppTest) -> str:
    """Every piece of text the run produced (markdown, alerts, captions, metrics), for `in` checks."""
    parts = []
    for kind in ("markdown", "caption", "error", "warning", "info", "success", "title", "subheader", "header"):
        parts += [str(e.value) for e in getattr(at, kind)]
    parts += [f"{m.label}: {m.value}" for m in at.metric]
    return "\n".join(parts)


def require(admin: httpx.Client, path: str) -> None:
    """Fail unless the control plane answers `path` with 200: a page test must not pass (or skip)
    because the endpoint it reads is missing or broken."""
    resp = admin.get(path)
    assert resp.status_code == 200, f"GET {path} -> {resp.status_code}: {resp.text[:300]}"
