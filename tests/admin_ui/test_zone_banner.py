"""The console says when a zone has lost all its shards, on every page, and lists members by zone."""

from __future__ import annotations

import httpx

from tests.support.cluster import ADMIN_TOKEN
from tests.support.console import ConsoleRunner, texts
from tests.support.procs import Service
from tests.support.waits import eventually

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_zone_down_banner_and_zone_column(monkeypatch, tmp_path) -> None:
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN]) as cp:
        shards = [Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", f"shard-{z}",
                           "--zone", z]) for z in ("east", "west")]
        try:
            for s in shards:
                s.start()
            console = ConsoleRunner(monkeypatch, tmp_path)
            console.point_at(cp.url)
            eventually(lambda: len(httpx.get(cp.url + "/admin/v1/members", headers=AUTH).json()["members"]) == 2, 10)
            at = console.page("cluster")
            assert "Zone down" not in texts(at)
            frame = at.dataframe[0].value
            assert dict(zip(frame["member"], frame["zone"])) == {"shard-east": "east", "shard-west": "west"}
            shards[0].kill()
            eventually(lambda: httpx.get(cp.url + "/admin/v1/zones", headers=AUTH).json()["down"] == ["east"], 15)
            for page in ("overview", "cluster"):
                shown = texts(console.page(page))
                assert "Zone down: **east**" in shown or "Zone down: east" in shown, page
        finally:
            for s in shards:
                s.stop()
