"""`switchboard dashboards push`: what it sends to Grafana, and its error without grafana-client."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dashboards import push as push_mod
from dashboards.push import DASHBOARD_DIR, load_dashboards, main, push


class FakeGrafana:
    """A Grafana at the edge: records what would be sent over its HTTP API."""

    def __init__(self) -> None:
        self.folders: dict[str, str] = {}
        self.dashboards: dict[str, tuple[dict[str, Any], str]] = {}

    def ensure_folder(self, title: str) -> str:
        return self.folders.setdefault(title, f"uid-{len(self.folders)}")

    def put_dashboard(self, dashboard: dict[str, Any], folder_uid: str) -> dict[str, Any]:
        self.dashboards[dashboard["uid"]] = (dashboard, folder_uid)
        return {"status": "success", "uid": dashboard["uid"]}


def test_push_puts_every_dashboard_in_the_folder() -> None:
    grafana = FakeGrafana()
    boards = load_dashboards()
    titles = push(grafana, boards, "LLM serving")
    assert titles == [b["title"] for b in boards] and len(titles) == 5
    assert set(grafana.folders) == {"LLM serving"}
    for board, folder_uid in grafana.dashboards.values():
        assert folder_uid == grafana.folders["LLM serving"] and board["id"] is None
    push(grafana, boards, "LLM serving")  # idempotent: same uids, overwritten
    assert len(grafana.dashboards) == 5 and len(grafana.folders) == 1


def test_missing_grafana_client_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grafana_client", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as exc:
        main(["push", "--grafana-url", "http://127.0.0.1:1", "--token", "t"])
    assert "grafana-client" in str(exc.value) and "switchboard[grafana]" in str(exc.value)


def test_token_from_environment_or_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(push_mod.TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["push", "--grafana-url", "http://127.0.0.1:1"])
    assert push_mod.TOKEN_ENV in str(exc.value)


def test_push_main_with_an_adapter(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    grafana = FakeGrafana()
    seen: dict[str, str] = {}

    def connect(url: str, token: str) -> FakeGrafana:
        seen.update(url=url, token=token)
        return grafana

    monkeypatch.setattr(push_mod, "connect", connect)
    monkeypatch.setenv(push_mod.TOKEN_ENV, "glsa_env")
    main(["push", "--grafana-url", "http://grafana:3000"])
    assert seen == {"url": "http://grafana:3000", "token": "glsa_env"}
    assert set(grafana.folders) == {"Switchboard"} and len(grafana.dashboards) == 5
    assert "pushed 'Switchboard / Overview'" in capsys.readouterr().out


def test_bad_dashboard_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit) as exc:
        main(["push", "--grafana-url", "http://127.0.0.1:1", "--token", "t", "--dir", str(tmp_path)])
    assert "broken.json" in str(exc.value)
    assert json.loads((DASHBOARD_DIR / "overview.json").read_text())["uid"] == "switchboard-overview"
