"""The console's Cluster page with a real 2-stage torch shard (--pipeline-parallel-size 2) registered
with a real control plane: its stages, their host and their layers (the shard's registration
metadata), in Streamlit's AppTest and in a real browser (a screenshot, when Chromium is installed:
to a temporary folder, or to docs/img/ with SWITCHBOARD_UPDATE_SCREENSHOTS=1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

pytest.importorskip("streamlit")

from admin_ui.screenshot import Chromium, find_chromium
from tests.support.cluster import ADMIN_TOKEN
from tests.support.console import ConsoleRunner, texts
from tests.support.formats import INVARIANT_ARGS
from tests.support.live_platform import console_service
from tests.support.procs import Service
from tests.support.waits import eventually

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def test_cluster_page_shows_a_pipelined_shards_stages_and_hosts(monkeypatch, tmp_path) -> None:
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN]) as cp:
        shard = Service(["shard", *INVARIANT_ARGS, "--threads", "1", "--pipeline-parallel-size", "2",
                         "--max-model-len", "512", "--registry-url", cp.url, "--node-id", "shard-pp"], ready_timeout=240)
        try:
            shard.start()
            members = lambda: httpx.get(cp.url + "/admin/v1/members", headers=AUTH).json()["members"]
            eventually(lambda: len(members()) == 1, 20, what="the shard registered")
            assert members()[0]["meta"]["pipeline_stages"] == "0@127.0.0.1:0-11,1@127.0.0.1:11-30"
            console = ConsoleRunner(monkeypatch, tmp_path)
            console.point_at(cp.url)
            at = console.page("cluster")
            assert not at.error, [e.value for e in at.error]
            assert "Pipeline stages" in texts(at)
            stages = next(d.value for d in at.dataframe if "layers" in d.value.columns)
            assert list(stages["member"]) == ["shard-pp", "shard-pp"]
            assert list(stages["host"]) == ["127.0.0.1", "127.0.0.1"]
            assert list(stages["layers"]) == ["0..10", "11..29"]
            assert list(stages["stage"]) == ["1 of 2", "2 of 2"]

            if find_chromium() is None:
                return
            out = DOCS_IMG if os.environ.get("SWITCHBOARD_UPDATE_SCREENSHOTS") == "1" else tmp_path / "img"
            credentials = tmp_path / "credentials.json"
            credentials.write_text(json.dumps({"keys": {}, "admin_token": ADMIN_TOKEN}))
            target = out / "console-cluster-pipeline.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            with console_service(cp.url, "http://127.0.0.1:1", credentials) as ui, Chromium(token=ADMIN_TOKEN) as browser:
                # a first draw takes ~50 s on this loaded 2-core host: a generous bound
                browser.capture(ui.url + "/cluster", target, expect=["Cluster", "Updated ", "Pipeline stages"],
                                timeout=240)
            assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and target.stat().st_size > 30_000
        finally:
            shard.stop()
