"""The cluster token on internal hops: a shard's chat API, cache-node session routes and every
process's /debug/spans refuse a caller without it (real processes, started with SWITCHBOARD_CLUSTER_TOKEN as
`switchboard up` starts them), and the gateway's own hops present it. Every process's /metrics takes it
or the read-only metrics token (SWITCHBOARD_METRICS_TOKEN), which opens nothing else.

    .venv/bin/python -m pytest tests/data_plane/test_hop_auth.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.chat import assert_openai_error, chat
from tests.support.cluster import KEYS, Cluster, api_keys_env
from tests.support.metrics import metric, metric_in, scrape, series
from tests.support.procs import CLUSTER_TOKEN, METRICS_HEADERS, METRICS_TOKEN, Service
from tests.support.waits import eventually

GOOD = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}
BAD = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": CLUSTER_TOKEN}, {"Authorization": f"Basic {CLUSTER_TOKEN}"}]
BAD_FOR_METRICS = [*BAD, {"Authorization": METRICS_TOKEN}, {"Authorization": f"Bearer {METRICS_TOKEN}x"},
                   {"Authorization": f"Bearer {CLUSTER_TOKEN[:-1]}"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(shards=1, caches=1, token_delay_ms=1) as c:
        yield c


def test_a_cache_node_read_or_write_without_the_cluster_token_is_401(cluster: Cluster) -> None:
    node = cluster.caches[0].url
    before = metric(node, "switchboard_cache_refused_total", route="sessions")
    for headers in BAD:
        for method, body in (("GET", None), ("PUT", {"owner": "o", "messages": [], "version": 1}), ("DELETE", None)):
            r = httpx.request(method, node + "/v1/sessions/sess_x", json=body, headers=headers)
            assert r.status_code == 401, (method, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_cluster_token"
    assert metric(node, "switchboard_cache_refused_total", route="sessions") == before + 3 * len(BAD)
    assert httpx.get(node + "/v1/sessions/sess_x", headers=GOOD).status_code == 404
    assert httpx.get(node + "/health").status_code == 200  # health stays open (probes)


def test_a_cache_nodes_refusals_are_counted_under_the_route_refused(cluster: Cluster) -> None:
    """Every guarded API of a cache node counted its refusals as route="sessions": a shard fetching KV blocks
    without the token, or a gateway's response cache, showed as refused session reads."""
    node = cluster.caches[0].url
    calls = {"sessions": ("GET", "/v1/sessions/sess_x", None),
             "response_cache": ("GET", "/v1/response-cache/rc_x", None),
             "kv": ("POST", "/v1/kv/fetch", {"hashes": []}),
             "debug_spans": ("GET", "/debug/spans", None)}
    for route, (method, path, body) in calls.items():
        before = {r: metric(node, "switchboard_cache_refused_total", route=r) for r in calls}
        r = httpx.request(method, node + path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_token", (path, r.text)
        after = {r: metric(node, "switchboard_cache_refused_total", route=r) for r in calls}
        assert after == {**before, route: before[route] + 1}, (path, before, after)


REFUSALS: dict[str, tuple[str, dict[str, tuple[str, str, Any]]]] = {"gateway": ("switchboard_gateway_refused_total", {"debug_spans": ("GET", "/debug/spans", None),
                                                              "metrics": ("GET", "/metrics", None)}),
            "shard": ("switchboard_shard_refused_total", {
                "chat": ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                "debug_spans": ("GET", "/debug/spans", None), "metrics": ("GET", "/metrics", None)}),
            "cache": ("switchboard_cache_refused_total", {"metrics": ("GET", "/metrics", None)}),
            "control_plane": ("switchboard_control_plane_refused_total", {
                "debug_spans": ("GET", "/debug/spans", None), "metrics": ("GET", "/metrics", None)})}


def test_every_token_refusal_is_counted_on_the_process_that_refused_it(cluster: Cluster) -> None:
    """A shard's chat API called without the cluster token answered 401 and no counter moved; /metrics
    refused a scraper (401 invalid_metrics_token) uncounted on every process, as was the gateway's
    /debug/spans: a member or a Prometheus with the wrong token was visible only in the logs. Each is
    counted under its route, every route's series there at 0 before the first refusal."""
    procs = {"gateway": cluster.gateway, "shard": cluster.shards[0], "cache": cluster.caches[0],
             "control_plane": cluster.control_plane}
    for proc, (name, calls) in REFUSALS.items():
        url = procs[proc].url
        text = scrape(url)
        assert all(series(text, name, route=r) for r in calls), (name, [r for r in calls if not series(text, name, route=r)])
        for route, (method, path, body) in calls.items():
            before = {r: metric(url, name, route=r) for r in calls}
            r = httpx.request(method, url + path, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
            assert r.status_code == 401, (proc, path, r.text)
            after = {r: metric(url, name, route=r) for r in calls}
            assert after == {**before, route: before[route] + 1}, (proc, path, before, after)


def test_a_bad_api_key_is_a_requests_code_not_a_token_refusal(cluster: Cluster) -> None:
    """The gateway's user-facing 401s are counted once, in switchboard_gateway_requests_total{code}."""
    gw = cluster.gateway.url
    before = metric(gw, "switchboard_gateway_refused_total")
    r = chat(gw, "plus", "hello", max_tokens=2, key="sk-not-a-key-0123456789")
    assert_openai_error(r, 401, "invalid_api_key")
    assert metric(gw, "switchboard_gateway_refused_total") == before


def test_debug_spans_need_the_cluster_token_on_every_process(cluster: Cluster) -> None:
    for svc in [cluster.gateway, *cluster.shards, *cluster.caches, cluster.control_plane]:
        for headers in BAD:
            r = httpx.get(svc.url + "/debug/spans", headers=headers)
            assert r.status_code == 401, (svc.args[3], headers)
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(svc.url + "/debug/spans", headers=GOOD).status_code == 200


def test_the_gateways_hops_present_the_token(cluster: Cluster) -> None:
    first = chat(cluster.gateway.url, "plus", "hello", headers={"X-Session-Id": "new"}, max_tokens=4)
    assert first.status_code == 200
    again = chat(cluster.gateway.url, "plus", "again", headers={"X-Session-Id": first.headers["x-session-id"]},
                 max_tokens=4)
    assert again.status_code == 200  # the session was written to and read from the node
    traces = httpx.get(cluster.control_plane.url + "/admin/v1/traces", params={"limit": 5},
                       headers={"Authorization": "Bearer test-admin-token"}).json()
    assert all(v == "ok" for v in traces["sources"].values()), traces["sources"]


def test_a_shards_chat_api_without_the_cluster_token_is_401(cluster: Cluster) -> None:
    """Generation straight from a shard would skip the gateway's keys, rate limits, safety filter and
    ledger, and could name another tenant's `cache_salt` or session: only a caller with the token."""
    shard = cluster.shards[0].url
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "cache_salt": "another-tenant"}
    for path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
        for headers in BAD:
            r = httpx.post(shard + path, json=body, headers=headers, timeout=30)
            assert_openai_error(r, 401, "invalid_cluster_token")
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.post(shard + path, json=body, headers=GOOD, timeout=30).status_code == 200, path
    assert httpx.get(shard + "/health").status_code == 200  # health stays open (probes)


def test_a_gateway_with_another_token_is_a_5xx_never_the_clients_401(cluster: Cluster) -> None:
    """A shard's 401 is the gateway's misconfiguration, not a bad API key: the client must not be told
    its key is invalid (the SDK would raise AuthenticationError)."""
    gw = Service(["gateway", "--shard-urls", cluster.shards[0].url, "--cache-urls", cluster.caches[0].url],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env(), "SWITCHBOARD_CLUSTER_TOKEN": "not-the-token"})
    with gw:
        r = chat(gw.url, "plus", "hello", max_tokens=2, key=KEYS["plus"])
        err = assert_openai_error(r, 502, "upstream_error")
        assert "cluster token" in err["message"]
        assert metric(gw.url, "switchboard_router_upstream_failures_total", reason="refused") >= 1


def test_the_gateways_metrics_name_tenants_only_to_a_caller_with_a_token(cluster: Cluster) -> None:
    """The gateway serves /metrics on its public chat port, and its series name tenants and their token
    volumes (switchboard_admission_tenant_service_tokens): anyone who could reach the chat API read which
    tenants exist and how much they use. Without the metrics or the cluster token: a 401 in the shape of
    every other guarded route, and not one series."""
    assert chat(cluster.gateway.url, "enterprise", "hello", max_tokens=4).status_code == 200
    gw = cluster.gateway.url
    for headers in BAD_FOR_METRICS:
        r = httpx.get(gw + "/metrics", headers=headers)
        err = assert_openai_error(r, 401, "invalid_metrics_token")
        assert "SWITCHBOARD_METRICS_TOKEN" in err["message"] and r.headers["www-authenticate"] == "Bearer"
        assert "switchboard_" not in r.text and "bigco" not in r.text and "acme" not in r.text, r.text
    for token in (METRICS_TOKEN, CLUSTER_TOKEN):  # either opens it
        text = scrape(gw, {"Authorization": f"Bearer {token}"})
        assert metric_in(text, "switchboard_admission_tenant_service_tokens", tier="enterprise", tenant="bigco") > 0
    assert "switchboard_gateway_requests_total" in httpx.get(gw + "/metrics", headers=METRICS_HEADERS).text


def test_every_processes_metrics_need_the_metrics_or_the_cluster_token(cluster: Cluster) -> None:
    """One rule for every scrape target: shards, cache nodes and the control plane guard /metrics as the
    gateway does (their series are traffic volumes, membership, abuse actions; a label added later is
    covered already); /health stays open for probes and load balancers."""
    for svc in [*cluster.shards, *cluster.caches, cluster.control_plane]:
        for headers in BAD_FOR_METRICS:
            r = httpx.get(svc.url + "/metrics", headers=headers)
            assert_openai_error(r, 401, "invalid_metrics_token")
            assert "switchboard_" not in r.text and "vllm:" not in r.text and "process_" not in r.text
        for token in (METRICS_TOKEN, CLUSTER_TOKEN):
            assert "process_cpu_seconds_total" in scrape(svc.url, {"Authorization": f"Bearer {token}"})
        assert httpx.get(svc.url + "/health").status_code == 200


def test_the_metrics_token_opens_metrics_and_nothing_else(cluster: Cluster) -> None:
    """What Prometheus holds cannot generate on a shard (prompts), read a cache node's transcripts, read
    spans or join the registry: a leaked scrape config is a leak of metrics, not of the cluster."""
    shard, node, cp = cluster.shards[0].url, cluster.caches[0].url, cluster.control_plane.url
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert_openai_error(httpx.post(shard + "/v1/chat/completions", json=body, headers=METRICS_HEADERS, timeout=30),
                        401, "invalid_cluster_token")
    assert_openai_error(httpx.get(node + "/v1/sessions/sess_x", headers=METRICS_HEADERS), 401, "invalid_cluster_token")
    for svc in [cluster.gateway, *cluster.shards, *cluster.caches, cluster.control_plane]:
        assert httpx.get(svc.url + "/debug/spans", headers=METRICS_HEADERS).status_code == 401
    member = {"service": "shard", "url": "http://127.0.0.1:9"}
    assert_openai_error(httpx.put(cp + "/v1/registry/members/intruder", json=member, headers=METRICS_HEADERS), 401,
                        "invalid_cluster_token")


def test_the_control_planes_scraper_reads_the_guarded_members(cluster: Cluster) -> None:
    """The embedded signal reader (control_plane/signals/scrape.py) presents the token: the admin API's
    live signals have every shard's engine gauges, none a scrape error."""
    admin = {"Authorization": "Bearer test-admin-token"}

    def shards() -> list[dict]:
        latest = httpx.get(cluster.control_plane.url + "/admin/v1/signals", headers=admin, timeout=10).json()["latest"]
        return list((latest or {}).get("shards") or [])

    def read() -> bool:
        seen = shards()
        return len(seen) == len(cluster.shards) and all(s["error"] is None and s["max_num_seqs"] for s in seen)
    eventually(read, 20, 0.2, what="signals from every shard", detail=lambda: str(shards()))
