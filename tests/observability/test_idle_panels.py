"""A calm fleet's panels read 0, not "No data": the counters of events an idle system never sees exist
from the start (each exporter creates its known label values at 0: tiers, shed and retry reasons, safety
categories, limiter operations), and the panels whose labels are open fall back to 0 with `or on (...)`
over a series of the same targets, so a missing target still reads as missing.

A synthetic-engine Cluster and a real Prometheus scraping it every second, with no request sent.
Skips when the `prometheus` binary is absent (`apt-get install prometheus`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.observability.exprs import dashboards, panels, substitute
from tests.support.cluster import Cluster
from tests.support.prometheus import PROMETHEUS, watched
from tests.support.waits import eventually

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")

IDLE_ZERO = {
    "gateway.json": ["Rate-limit rejections / s by tier and kind", "Rate-limit rejection ratio by tier",
                     "Rate-limit backend", "Admission shed / s by tier and reason", "Safety blocks / s",
                     "Safety block ratio by stage", "Retries / s by reason", "Context messages dropped / s"],
    "data-plane.json": ["Rejected before compute / s"],
}
"""Panels of events a healthy, idle system never sees: each of their targets must read 0."""


def test_an_idle_fleets_event_panels_read_zero(tmp_path: Path) -> None:
    cluster = Cluster(shards=1, caches=1, engine="synthetic")
    with watched(cluster, tmp_path) as prometheus:
        eventually(lambda: prometheus.value('count(up{job=~"switchboard-.*"} == 1)') == 4, 20,
                   what="all 4 targets up")
        time.sleep(3)  # rate() needs two samples of each series
        boards = dashboards()
        problems = []
        for fname, titles in IDLE_ZERO.items():
            by_title = {p["title"]: p for p in panels(boards[fname])}
            for title in titles:
                for target in by_title[title]["targets"]:
                    result = prometheus.query(substitute(target["expr"]))["data"]["result"]
                    values = [float(sample["value"][1]) for sample in result]
                    if target["expr"].startswith("min by (instance) (switchboard_ratelimit_backend_up)"):
                        values = [v - 1 for v in values]  # the backend's up gauge reads 1
                    if not values or any(v != 0 for v in values):
                        problems.append(f"{fname}: {title} [{target['refId']}]: {values or 'no data'}")
        assert not problems, "\n".join(problems)
