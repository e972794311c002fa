"""vLLM's Grafana dashboards fill on Switchboard: every panel of tests/observability/vllm_panels.py's
FILLS has its series, with its labels, moving in a real Prometheus that scrapes a real cluster; and the
panels that cannot apply (CANNOT_APPLY) are exactly the ones docs/metrics.md explains.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/observability/test_vllm_dashboards.py -q   # ~2 min

One torch shard (the real model; prefix cache small enough to evict, n-gram speculation on, KV tier
on) and one cache node. The traffic: a quote repeated (prefix-cache hits, accepted drafts), a session
(KV stored on the cache node), distinct prompts (evictions), streamed and not. vLLM's own JSON is never
in the repository: run `switchboard dashboards check --dir DIR --prometheus URL` on a copy of it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from dashboards.catalogue import NOTES
from dashboards.check import HttpPrometheus, check_dir
from tests.observability.vllm_panels import CANNOT_APPLY, FILLS, NO_MODEL_NAME, parse
from tests.support.cluster import Cluster
from tests.support.formats import INVARIANT_ARGS
from tests.support.prometheus import PROMETHEUS, Prometheus, watched
from tests.support.waits import eventually

BLOCK_BYTES = 2 * 30 * 3 * 16 * 64 * 4  # SmolLM2-135M, float32: one 16-token block of K and V
QUOTE = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
TOPICS = ("rivers", "volcanoes", "glaciers", "deserts", "forests", "coral reefs")
OTHER_DASHBOARDS = {"`vllm:mm_cache_*`"}
"""Bullets of docs/metrics.md about queries inside panels that still fill (no whole panel is empty)."""


def doc_bullets() -> set[str]:
    section = NOTES.split("## vLLM dashboard panels that cannot apply here", 1)[1]
    return set(re.findall(r"^- (`[^`]+`)", section, flags=re.MULTILINE))


def test_cannot_apply_matches_docs() -> None:
    whys = {skip.why for skip in CANNOT_APPLY}
    bullets = doc_bullets()
    assert whys <= bullets, f"panels whose reason docs/metrics.md does not give: {sorted(whys - bullets)}"
    assert bullets - whys == OTHER_DASHBOARDS, f"bullets no panel points at: {sorted(bullets - whys - OTHER_DASHBOARDS)}"
    listed = [(p.dashboard, p.title) for p in FILLS] + [(s.dashboard, s.title) for s in CANNOT_APPLY]
    assert len(set(listed)) == len(listed), "a panel is listed twice (or both fills and cannot apply)"


def drive(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {cluster.keys['plus']}"}
    with httpx.Client(base_url=cluster.gateway.url, timeout=300.0) as http:
        def chat(content: str, max_tokens: int, **headers: str) -> None:
            r = http.post("/v1/chat/completions", headers={**auth, **headers},
                          json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
            assert r.status_code == 200, r.text
        chat(QUOTE, 24, **{"X-Session-Id": "new"})  # a session: its KV goes to the cache node
        for _ in range(2):
            chat(QUOTE, 24)  # prefix-cache hits; the quote's n-grams make drafts that are accepted
        with http.stream("POST", "/v1/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": QUOTE}], "max_tokens": 8, "stream": True}) as stream:
            assert stream.status_code == 200 and b"[DONE]" in stream.read()
        for topic in TOPICS:  # distinct prompts overflow the small prefix cache: blocks are evicted
            chat(f"Write three long sentences about {topic}, their history and the people living near them.", 4)


def present(prometheus: Prometheus, series: str) -> bool:
    name, labels, moving = parse(series)
    matchers = [f'{k}="{v}"' if v is not None else f'{k}!=""' for k, v in labels.items()]
    if name.startswith("vllm:") and name not in NO_MODEL_NAME:
        matchers.append('model_name!=""')
    selector = f"{name}{{{', '.join(matchers)}}}"
    expr = f"sum(increase({selector}[10m])) > 0" if moving else f"count({selector})"
    return bool(prometheus.query(expr)["data"]["result"])


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_vllm_dashboard_panels_fill(tmp_path: Path) -> None:
    cluster = Cluster(shards=1, caches=1, engine="torch", shard_args=[
        *INVARIANT_ARGS, "--max-num-seqs", "4", "--max-model-len", "1024",
        "--prefix-cache-bytes", str(12 * BLOCK_BYTES)])
    with watched(cluster, tmp_path) as prometheus:
        drive(cluster)
        time.sleep(2)
        drive(cluster)  # a second wave, scraped apart from the first: every counter has an increase
        missing: list[str] = []

        def all_there() -> bool:
            missing[:] = [f"{p.dashboard}: {p.title}: {s}" for p in FILLS for s in p.series
                          if not present(prometheus, s)]
            return not missing
        try:
            eventually(all_there, 20, what="every manifest panel's series in Prometheus")
        except AssertionError:
            raise AssertionError("panels without their series:\n" + "\n".join(missing)) from None
        # The checker over our own dashboards, on the same Prometheus: it runs every query and finds data.
        boards = check_dir(HttpPrometheus(prometheus.url), Path(__file__).resolve().parents[2] / "dashboards" / "grafana",
                           window="10m")
        assert not [p.errors for b in boards for p in b.panels if p.errors]
        overview = next(b for b in boards if b.file == "overview.json")
        assert overview.filled > len(overview.panels) // 2, [p.title for p in overview.panels if not p.filled]
