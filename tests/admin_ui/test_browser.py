"""The console in a real browser: headless Chromium over the DevTools protocol, with screenshots.

Runs against a live platform with traffic (autoscaling control plane, synthetic shards, gateway).
Screenshots go to a temporary folder, or to ``docs/img/`` with ``SWITCHBOARD_UPDATE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from admin_ui.screenshot import find_chromium

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_chromium() is None, reason="no chromium binary (apt-get install chromium)"),
]
pytest.importorskip("websocket", reason="needs websocket-client")
pytest.importorskip("streamlit")

from tests.support.live_platform import SHOT_PAGES, LivePlatform, screenshot_tour

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def test_console_in_chromium_shows_the_live_platform(tmp_path):
    out = DOCS_IMG if os.environ.get("SWITCHBOARD_UPDATE_SCREENSHOTS") == "1" else tmp_path / "img"
    with LivePlatform(tmp_path / "state") as platform:
        counts = platform.traffic(12)
        assert any(k.endswith(":200") for k in counts), counts
        background = threading.Thread(target=platform.traffic, args=(60,), kwargs={"workers": 4}, daemon=True)
        background.start()
        with platform.console() as console:
            written = screenshot_tour(console.url, out)
        assert platform.shards_passing() >= 2, "the autoscaler should have scaled out under the queueing load"
        background.join(90)
    names = {p.name for p in written}
    assert names == {f"console-{p}.png" for p in [*SHOT_PAGES, "playground", "traces"]}
    for path in written:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000, path
