"""The cluster token on internal hops: a shard's chat API, cache-node session routes and every
process's /debug/spans refuse a caller without it (real processes, started with SWITCHBOARD_CLUSTER_TOKEN as
`switchboard up` starts them), and the gateway's own hops present it.

    .venv/bin/python -m pytest tests/data_plane/test_hop_auth.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.chat import assert_openai_error, chat
from tests.support.cluster import KEYS, Cluster, api_keys_env
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_TOKEN, Service

GOOD = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}
BAD = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": CLUSTER_TOKEN}, {"Authorization": f"Basic {CLUSTER_TOKEN}"}]


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
    assert httpx.get(node + "/health").status_code == 200  # health and metrics stay open


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
    assert httpx.get(shard + "/health").status_code == 200  # health and metrics stay open


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
