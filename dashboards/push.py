"""Push the Switchboard dashboards to a Grafana over its HTTP API.

    pip install 'switchboard[grafana]'          # grafana-client: optional, never in a serving process
    switchboard dashboards push --grafana-url https://grafana.example.org --token glsa_xxx
    switchboard dashboards push --grafana-url http://127.0.0.1:3000 --folder "LLM serving"
    GRAFANA_TOKEN=glsa_xxx switchboard dashboards push --grafana-url http://127.0.0.1:3000

Every ``dashboards/grafana/*.json`` is created or overwritten (matched by its ``uid``) in the
folder, which is created when missing. Without Grafana's API, use file provisioning instead:
``dashboards/provisioning/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

DASHBOARD_DIR = Path(__file__).resolve().parent / "grafana"
"""The dashboards' JSON, one file per dashboard."""

TOKEN_ENV = "GRAFANA_TOKEN"
"""Environment variable read when ``--token`` is not given (keeps the token out of shell history)."""

DEFAULT_FOLDER = "Switchboard"
INSTALL_HINT = "pip install 'switchboard[grafana]'   (or: pip install grafana-client)"


class Grafana(Protocol):
    """What pushing needs from a Grafana; :class:`GrafanaClientAdapter` is the real one."""

    def ensure_folder(self, title: str) -> str:
        """The uid of the folder titled `title`, created when missing."""
        ...

    def put_dashboard(self, dashboard: dict[str, Any], folder_uid: str) -> dict[str, Any]:
        """Create or overwrite `dashboard` (matched by uid) in the folder."""
        ...


class GrafanaClientAdapter:
    """:class:`Grafana` over ``grafana_client.GrafanaApi`` (the optional ``grafana`` extra)."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def ensure_folder(self, title: str) -> str:
        for folder in self.api.folder.get_all_folders():
            if folder.get("title") == title:
                return str(folder["uid"])
        uid = re.sub(r"[^a-z0-9-]+", "-", title.lower()).strip("-")[:40] or "switchboard"
        return str(self.api.folder.create_folder(title, uid=uid)["uid"])

    def put_dashboard(self, dashboard: dict[str, Any], folder_uid: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api.dashboard.update_dashboard({
            "dashboard": dashboard, "folderUid": folder_uid, "overwrite": True,
            "message": "switchboard dashboards push",
        })
        return result


def connect(url: str, token: str) -> GrafanaClientAdapter:
    """A :class:`Grafana` for `url`; SystemExit with an install hint when grafana-client is missing."""
    try:
        from grafana_client import GrafanaApi  # lazy: optional extra, takes over `import urllib3`
    except ImportError:
        raise SystemExit("switchboard dashboards push: the grafana-client package is not installed.\n"
                         f"  {INSTALL_HINT}\n"
                         "Or provision the JSON files instead: see dashboards/provisioning/dashboards.yaml") from None
    return GrafanaClientAdapter(GrafanaApi.from_url(url=url, credential=token))


def load_dashboards(directory: Path = DASHBOARD_DIR) -> list[dict[str, Any]]:
    """Every dashboard JSON in `directory`, sorted by file name; ValueError names a bad file."""
    boards = []
    for path in sorted(directory.glob("*.json")):
        try:
            board = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(board, dict) or not board.get("uid") or not board.get("title"):
            raise ValueError(f"{path}: a dashboard needs a 'uid' and a 'title'")
        boards.append(board)
    if not boards:
        raise ValueError(f"no dashboards (*.json) in {directory}")
    return boards


def push(grafana: Grafana, dashboards: Sequence[dict[str, Any]], folder: str = DEFAULT_FOLDER) -> list[str]:
    """Create or overwrite each dashboard in `folder`; returns the titles pushed, in order."""
    folder_uid = grafana.ensure_folder(folder)
    pushed = []
    for board in dashboards:
        # `id` is per Grafana instance; the uid is what identifies the dashboard across instances.
        grafana.put_dashboard({**board, "id": None}, folder_uid)
        pushed.append(str(board["title"]))
    return pushed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchboard dashboards",
                                     description="Grafana dashboards for Switchboard.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("push", help="create or update the dashboards in a Grafana over its HTTP API")
    p.add_argument("--grafana-url", required=True, metavar="URL", help="Grafana base URL, e.g. http://127.0.0.1:3000")
    p.add_argument("--token", metavar="T", help=f"service-account token (default: ${TOKEN_ENV})")
    p.add_argument("--folder", default=DEFAULT_FOLDER, metavar="F", help=f"folder title (default: {DEFAULT_FOLDER})")
    p.add_argument("--dir", type=Path, default=DASHBOARD_DIR, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"switchboard dashboards push: give --token or set {TOKEN_ENV}")
    try:
        dashboards = load_dashboards(args.dir)
    except ValueError as exc:
        raise SystemExit(f"switchboard dashboards push: {exc}") from None
    grafana = connect(args.grafana_url, token)
    try:
        titles = push(grafana, dashboards, args.folder)
    except Exception as exc:  # noqa: BLE001  the client's HTTP / connection errors, reported once, here
        raise SystemExit(f"switchboard dashboards push: {args.grafana_url}: {type(exc).__name__}: {exc}") from None
    for title in titles:
        print(f"pushed {title!r} to folder {args.folder!r}")


if __name__ == "__main__":
    main()
