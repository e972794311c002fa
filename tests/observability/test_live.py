"""The proof: every dashboard query and rule evaluates against a real Prometheus scraping a real cluster.

A synthetic-engine :class:`~tests.support.cluster.Cluster` and a Prometheus (Debian's `prometheus` binary, on
a free loopback port, scraping every second with the job names the rules assume) run side by side.
After two waves of traffic (normal, streamed, sessions, a few 4xx, one request a shard refuses)
every panel query and every rule expression must parse; every panel of the Overview, Data plane and
Control plane dashboards must return data, except the autoscaler's (:data:`NEEDS_AUTOSCALER`). Then one shard is killed and `SwitchboardShardDown` must fire
(rules loaded from a copy with `for: 0s` and 1 s evaluation).

Skips when the `prometheus` binary is absent (`apt-get install prometheus`, or `make sysdeps`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.observability.exprs import NEEDS_PIPELINE, dashboard_exprs, fast_rules, rule_exprs, substitute
from tests.support.cluster import Cluster
from tests.support.metrics import scrape
from tests.support.procs import CLUSTER_HEADERS
from tests.support.prometheus import PROMETHEUS, Prometheus, watched
from tests.support.waits import eventually

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")

MUST_HAVE_DATA = {"overview.json", "data-plane.json", "control-plane.json"}

NEEDS_AUTOSCALER = "switchboard_autoscaler_"
"""Panels selecting these series may be empty: the control plane creates AutoscalerMetrics only with
``--autoscale`` (control_plane.scaling.loop.build_autoscaler), which the test Cluster does not pass, and
an autoscaler here would start and stop shards of its own. They must still parse; the test asserts
the control plane really exports none of them, so this exemption lapses loudly if that changes."""

NEEDS_UP = "switchboard_up_process_"
"""`switchboard up`'s supervisor table (control_plane/admin/processes.py) is served by a control plane that
`up` started; the test Cluster starts its processes itself, without a table. The series are checked on a
real `up` in tests/control_plane/test_up_processes.py; the test asserts the Cluster's control plane really
exports none, so this exemption lapses loudly if that changes."""

NEEDS_PREFIX_LOOKUPS = "vllm:prefix_cache_hits_total"
"""The hit-rate panel divides by prompt tokens looked up in the prefix cache, and the synthetic engine
the test Cluster runs keeps no KV (it never looks up): 0 / 0 is NaN there. The torch engine's lookups
are tested in tests/data_plane/test_prefix_cache.py; the test asserts the synthetic shards really
report no lookups, so this exemption lapses loudly if that changes."""

NEEDS_TORCH_THREADS = "switchboard_shard_intra_op_threads"
"""The torch engine reports its intra-op thread count (data_plane/shard/engines/torch_threads.py); the
synthetic engine the test Cluster runs has no torch threads and no such series. The torch shard's is
checked in tests/data_plane/test_shard.py; the test asserts the synthetic shards really report none,
so this exemption lapses loudly if that changes."""

NEEDS_SPECULATION = "vllm:spec_decode_"
"""The speculative-decoding panels divide by drafted tokens, and the synthetic engine the test Cluster
runs never drafts: 0 / 0 is NaN there. The torch engine's drafts are tested in
tests/data_plane/test_shard_speculation.py; the test asserts the synthetic shards really report no
drafts, so this exemption lapses loudly if that changes."""

NEEDS_GRAMMAR = ("switchboard_shard_grammar_compile_seconds", "switchboard_shard_grammar_mask_seconds")
"""The grammar compile and mask-time quantiles need a constrained request, which the synthetic engine the
test Cluster runs refuses (it has no grammar backend): NaN or no series there. The torch engine's are
tested in tests/data_plane/test_structured_api.py; the test asserts the synthetic shards really compiled
nothing, so this exemption lapses loudly if that changes."""

BAD_CARD = "my card is 4111 1111 1111 1111"  # the default input policy blocks card numbers (400)


def drive_traffic(cluster: Cluster) -> int:
    """One wave of chat traffic through the gateway; returns the requests the gateway will count."""
    keys = cluster.keys
    chat = {"messages": [{"role": "user", "content": "tell me about observability"}], "max_tokens": 8}
    sent = 0
    with httpx.Client(base_url=cluster.gateway.url, timeout=30.0) as http:
        def post(key: str, body: dict[str, Any], expect: int, headers: dict[str, str] | None = None) -> httpx.Response:
            nonlocal sent
            response = http.post("/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}", **(headers or {})})
            sent += 1
            assert response.status_code == expect, response.text
            return response

        for tier in ("free", "plus", "enterprise"):
            post(keys[tier], chat, 200)
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                         headers={"Authorization": f"Bearer {keys['plus']}"}) as stream:
            assert stream.status_code == 200
            assert b"[DONE]" in stream.read()
            sent += 1
        first = post(keys["plus"], chat, 200, {"X-Session-Id": "new"})
        session = first.headers["X-Session-Id"]
        post(keys["plus"], {**chat, "messages": [{"role": "user", "content": "and then?"}]}, 200,
             {"X-Session-Id": session})
        # deterministic repeats: a response-cache miss then hits (the overview's hit-rate panel)
        post(keys["plus"], {**chat, "temperature": 0}, 200)
        post(keys["plus"], {**chat, "temperature": 0}, 200)
        response = http.post("/v1/responses", json={"input": "tell me about observability", "max_output_tokens": 8},
                             headers={"Authorization": f"Bearer {keys['plus']}"})
        assert response.status_code == 200, response.text
        sent += 1  # a Responses API generation is a gateway request too
        post("sk-not-a-key-0123456789", chat, 401)
        post(keys["free"], {**chat, "model": "no-such-model"}, 404)
        post(keys["free"], {**chat, "messages": [{"role": "user", "content": BAD_CARD}]}, 400)
    # A request the shard itself refuses before compute (switchboard_shard_requests_rejected_total).
    refused = httpx.post(cluster.shards[0].url + "/v1/chat/completions", timeout=10.0, headers=CLUSTER_HEADERS,
                         json={**chat, "max_tokens": 10**6})
    assert refused.status_code == 400, refused.text
    return sent


def test_dashboards_and_rules_against_a_live_cluster(tmp_path: Path) -> None:
    cluster = Cluster(shards=2, caches=2, engine="synthetic", gateway_args=["--response-cache"])
    with watched(cluster, tmp_path, fast_rules(tmp_path)) as prometheus:
        check_queries_and_alert(cluster, prometheus)


def shard_requests(cluster: Cluster) -> float:
    """Requests the shards' engines finished so far, read from the shards themselves."""
    found = 0.0
    for shard in cluster.shards:
        for line in scrape(shard.url, timeout=5.0).splitlines():
            if line.startswith("vllm:e2e_request_latency_seconds_count"):
                found += float(line.rsplit(" ", 1)[1])
    return found


def check_queries_and_alert(cluster: Cluster, prometheus: Prometheus) -> None:
    total = "sum(switchboard_gateway_requests_total)"

    # Wave 1 creates the labelled series; wave 2, scraped later, makes every rate() non-zero.
    # Each wave must be scraped from every process before the next starts: targets are scraped at
    # staggered offsets, and a series whose first sample already holds both waves has no increase.
    engine_total = "sum(vllm:e2e_request_latency_seconds_count)"
    sent = drive_traffic(cluster)
    eventually(lambda: prometheus.value(total) >= sent, 20,
               what=f"Prometheus to scrape {sent} gateway requests")
    done = shard_requests(cluster)
    eventually(lambda: prometheus.value(engine_total) >= done, 20,
               what=f"Prometheus to scrape {done} shard requests")
    sent += drive_traffic(cluster)
    eventually(lambda: prometheus.value(total) >= sent, 20,
               what=f"Prometheus to scrape {sent} gateway requests")
    done = shard_requests(cluster)
    eventually(lambda: prometheus.value(engine_total) >= done, 20,
               what=f"Prometheus to scrape {done} shard requests")
    eventually(lambda: prometheus.value('count(up{job=~"switchboard-.*"} == 1)') == 6, 10,
               what="all 6 targets up")
    time.sleep(1.5)  # one more scrape of every target after the last request

    control_metrics = scrape(cluster.control_plane.url, timeout=5.0)
    assert NEEDS_AUTOSCALER not in control_metrics, "the control plane runs an autoscaler: drop NEEDS_AUTOSCALER"
    assert "switchboard_degradation_level " in control_metrics  # exported with the autoscaler off
    assert NEEDS_UP not in control_metrics, "the Cluster's control plane serves up's process table: drop NEEDS_UP"
    assert prometheus.value("sum(vllm:prefix_cache_queries_total)") == 0, "drop NEEDS_PREFIX_LOOKUPS"
    assert not prometheus.value("sum(vllm:spec_decode_num_drafts_total)") > 0, "drop NEEDS_SPECULATION"
    assert not prometheus.query(NEEDS_TORCH_THREADS)["data"]["result"], "drop NEEDS_TORCH_THREADS"
    assert not prometheus.query(f'{{__name__=~"{NEEDS_PIPELINE}.*"}}')["data"]["result"], "drop NEEDS_PIPELINE"
    assert not prometheus.value('sum(switchboard_shard_grammar_compiles_total{outcome="compiled"})') > 0, \
        "drop NEEDS_GRAMMAR"

    problems: list[str] = []
    for where, expr in dashboard_exprs():
        fname = where.split(":", 1)[0]
        answer = prometheus.query(substitute(expr))
        if answer.get("status") != "success":
            problems.append(f"{where}: {answer.get('errorType')}: {answer.get('error')}\n    {expr}")
            continue
        if fname not in MUST_HAVE_DATA or any(n in expr for n in (NEEDS_AUTOSCALER, NEEDS_UP, NEEDS_PREFIX_LOOKUPS,
                                                                  NEEDS_SPECULATION, NEEDS_TORCH_THREADS,
                                                                  NEEDS_PIPELINE, *NEEDS_GRAMMAR)):
            continue
        result = answer["data"]["result"]
        if not result:
            problems.append(f"{where}: no data\n    {expr}")
        elif all(math.isnan(float(sample["value"][1])) for sample in result):
            problems.append(f"{where}: only NaN (no increase in the window?)\n    {expr}")
    for where, expr, _ in rule_exprs():
        answer = prometheus.query(expr)
        if answer.get("status") != "success":
            problems.append(f"{where}: {answer.get('errorType')}: {answer.get('error')}")
    assert not problems, "\n".join(problems)

    groups = httpx.get(prometheus.url + "/api/v1/rules", timeout=5.0).json()["data"]["groups"]
    loaded = [rule for group in groups for rule in group["rules"]]
    assert len(loaded) == sum(1 for _ in rule_exprs())
    assert not [r["name"] for r in loaded if r["health"] == "err"], [r.get("lastError") for r in loaded]

    # Startup scrapes may have fired it before the shards were up; it must clear, then fire on a kill.
    eventually(lambda: not prometheus.alerts("SwitchboardShardDown"), 15,
               what="SwitchboardShardDown to clear")
    victim = cluster.shards[0]
    victim.kill()
    instance = victim.url.removeprefix("http://")
    eventually(lambda: any(a["labels"]["instance"] == instance for a in prometheus.alerts("SwitchboardShardDown")), 30, what=f"SwitchboardShardDown firing for {instance}")
    firing = prometheus.alerts("SwitchboardShardDown")
    assert [a["labels"]["instance"] for a in firing] == [instance]
    assert firing[0]["annotations"]["runbook_url"] == "docs/runbook.md#switchboardsharddown"
    assert not prometheus.alerts("SwitchboardNoHealthyShard"), "one shard is still up"
