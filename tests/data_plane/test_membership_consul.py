"""The Consul membership backend, against the Consul HTTP STUB (tests/support/consul_stub.py) and, when
``CONSUL_HTTP_ADDR`` is set, against that live agent too.

    .venv/bin/python -m pytest tests/data_plane/test_membership_consul.py -q
    CONSUL_HTTP_ADDR=127.0.0.1:8500 .venv/bin/python -m pytest tests/data_plane/test_membership_consul.py -q

Every test registers under its own service prefix (``sbtest<hex>-shard``), so a live agent's other
services are never touched. Tests that stop or restart Consul, or need the stub's sub-minute
``DeregisterCriticalServiceAfter``, run against the stub only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from data_plane.membership.consul import (
    ConsulMembership,
    ConsulRegistrationAgent,
    check_meta,
    consul_http_url,
    go_duration,
    member_from_health,
    member_status,
)
from data_plane.membership.embedded import HttpMembership, RegistrationAgent
from data_plane.membership.factory import membership_from_url
from data_plane.membership.view import Member
from tests.support.cluster import KEYS, api_keys_env
from tests.support.consul_stub import ConsulStub, consul_agent, consul_client
from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.waits import eventually, eventually_async


@pytest.fixture(scope="module", params=["stub", "live"])
def consul_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """``http://host:port`` of a Consul HTTP API: the stub, or the live agent in CONSUL_HTTP_ADDR."""
    with consul_agent(request.param) as url:
        yield url


@pytest.fixture
def prefix() -> str:
    return f"sbtest{uuid.uuid4().hex[:8]}-"


def ids(members: list[Member]) -> list[str]:
    return [m.id for m in members]


async def register_raw(http: httpx.AsyncClient, url: str, sid: str, name: str, ttl: str, **check: str) -> None:
    body = {"ID": sid, "Name": name, "Address": "127.0.0.1", "Port": 9,
            "Check": {"TTL": ttl, "Status": "passing", **check}}
    (await http.put(f"{url}/v1/agent/service/register", json=body)).raise_for_status()


async def heartbeat(http: httpx.AsyncClient, url: str, sid: str, every_s: float = 0.2) -> None:
    """Pass service `sid`'s TTL check every `every_s` until cancelled."""
    while True:
        (await http.put(f"{url}/v1/agent/check/pass/service:{sid}")).raise_for_status()
        await asyncio.sleep(every_s)


# -- pure functions -------------------------------------------------------------------------------


def test_consul_urls_and_durations() -> None:
    assert consul_http_url("consul://127.0.0.1:8500") == "http://127.0.0.1:8500"
    assert consul_http_url("consul+https://consul.internal") == "https://consul.internal:8501"
    assert consul_http_url("127.0.0.1:8500") == "http://127.0.0.1:8500"  # CONSUL_HTTP_ADDR style
    assert consul_http_url("http://[::1]:8500") == "http://[::1]:8500"
    with pytest.raises(ValueError):
        consul_http_url("redis://127.0.0.1:6379")
    assert go_duration(0.8) == "800ms" and go_duration(60) == "60000ms"


def test_meta_must_suit_consul() -> None:
    check_meta({"model": "SmolLM2-135M-Instruct", "max_model_len": "2048"})
    for bad in ({"has.dot": "x"}, {"consul-x": "x"}, {"url": "x"}, {"k": "v" * 513}):
        with pytest.raises(ValueError):
            check_meta(bad)


def test_member_from_a_health_entry() -> None:
    entry = {
        "Node": {"Node": "n1", "Address": "10.0.0.5"},
        "Service": {"ID": "shard-1", "Service": "switchboard-shard", "Address": "", "Port": 8101,
                    "Meta": {"model": "m"}},
        "Checks": [{"CheckID": "serfHealth", "Status": "passing"},
                   {"CheckID": "service:shard-1", "Status": "passing"}],
    }
    m = member_from_health(entry)
    assert m == Member("shard-1", "shard", "http://10.0.0.5:8101", meta={"model": "m"})  # no url meta: node address
    entry["Service"]["Meta"]["url"] = "https://shard-1.internal:8443/"
    m = member_from_health(entry)
    assert m is not None and m.url == "https://shard-1.internal:8443" and m.meta == {"model": "m"}
    assert member_from_health({**entry, "Service": {**entry["Service"], "Service": "redis"}}) is None
    assert member_status([{"CheckID": "service:x", "Status": "passing"},
                          {"CheckID": "_service_maintenance:x", "Status": "critical"}]) == "draining"
    assert member_status([{"CheckID": "service:x", "Status": "critical"},
                          {"CheckID": "_service_maintenance:x", "Status": "critical"}]) == "critical"
    assert member_status([{"CheckID": "service:x", "Status": "warning"}]) == "warning"


async def test_factory_picks_the_backend_by_scheme() -> None:
    async with consul_client() as http:
        view, new_agent = membership_from_url("consul://127.0.0.1:8500", http)
        assert isinstance(view, ConsulMembership)
        assert isinstance(new_agent(Member("s", "shard", "http://127.0.0.1:1"), 1.0), ConsulRegistrationAgent)
        view, new_agent = membership_from_url("http://127.0.0.1:8300", http)
        assert isinstance(view, HttpMembership)
        assert isinstance(new_agent(Member("s", "shard", "http://127.0.0.1:1"), 1.0), RegistrationAgent)
        with pytest.raises(ValueError, match="unknown membership URL"):
            membership_from_url("zookeeper://127.0.0.1:2181", http)


# -- against Consul (stub and live) ---------------------------------------------------------------


async def test_registered_member_appears_at_once_and_leaves_on_deregister(consul_url: str, prefix: str) -> None:
    member = Member(f"{prefix}shard-0", "shard", "http://127.0.0.1:8101", meta={"model": "m", "engine": "synthetic"})
    async with consul_client() as http:
        # a 30 s blocking query: seeing the member well inside it means the query answered on the change
        view = ConsulMembership(consul_url, http, services=("shard", "cache"), wait_s=30.0, service_prefix=prefix)
        changes: list[float] = []
        view.subscribe(lambda: changes.append(time.monotonic()))
        await view.start()
        assert view.reachable and view.members("shard") == []
        agent = ConsulRegistrationAgent(consul_url, member, http, ttl_s=1.0, service_prefix=prefix)
        try:
            await agent.start()
            assert agent.registered
            await eventually_async(lambda: ids(view.members("shard")) == [member.id], timeout_s=10.0,
                                   what="the member seen (hang bound, a third of the query's wait)")
            assert view.members("shard")[0] == member and view.members("cache") == []
            await asyncio.sleep(1.2)  # heartbeats keep it passing past its TTL, and wake nobody
            assert ids(view.members("shard")) == [member.id] and len(changes) == 1
            agent.set_meta(load="3")
            await eventually_async(lambda: view.members("shard")[0].meta.get("load") == "3", timeout_s=2.0)
        finally:
            await agent.aclose()
        assert not agent.registered
        await eventually_async(lambda: view.members("shard") == [], timeout_s=2.0)
        await view.aclose()


async def test_silent_member_goes_critical_after_its_ttl_and_leaves_routing(consul_url: str, prefix: str) -> None:
    async with consul_client() as http:
        live = ConsulMembership(consul_url, http, wait_s=5.0, service_prefix=prefix)
        every = ConsulMembership(consul_url, http, wait_s=5.0, service_prefix=prefix, passing_only=False)
        await live.start()
        await every.start()
        sid = f"{prefix}shard-silent"
        try:
            await register_raw(http, consul_url, sid, f"{prefix}shard", "1s")
            # it heartbeats until the view has seen it live, then falls silent: seeing it had to happen within its
            # 1 s TTL (a 0.9 s bound), and a loaded machine's late look found it critical already
            beating = asyncio.create_task(heartbeat(http, consul_url, sid))
            try:
                await eventually_async(lambda: ids(live.members("shard")) == [sid], timeout_s=10.0,
                                       what="the member seen live (hang bound)")
            finally:
                beating.cancel()
                await asyncio.gather(beating, return_exceptions=True)
            await eventually_async(lambda: live.members("shard") == [], timeout_s=5.0)
            await eventually_async(lambda: [m.status for m in every.all_members("shard")] == ["critical"], timeout_s=2.0)
            assert every.members("shard") == []  # known, but not routable
        finally:
            await http.put(f"{consul_url}/v1/agent/service/deregister/{sid}")
            await live.aclose()
            await every.aclose()


async def test_agent_registers_again_when_consul_forgets_it(consul_url: str, prefix: str) -> None:
    member = Member(f"{prefix}cache-0", "cache", "http://127.0.0.1:8201", meta={"backend": "memory"})
    async with consul_client() as http:
        view = ConsulMembership(consul_url, http, wait_s=5.0, service_prefix=prefix)
        await view.start()
        agent = ConsulRegistrationAgent(consul_url, member, http, ttl_s=0.6, service_prefix=prefix)
        try:
            await agent.start()
            await eventually_async(lambda: ids(view.members("cache")) == [member.id], timeout_s=10.0)
            # an operator (or the agent's reaper) removes it; the next heartbeat's 404 re-registers it. The view
            # may never show the gap (its blocking query can answer once, after both changes): Consul's own list
            # holding it again after a deregistration that succeeded is the proof.
            (await http.put(f"{consul_url}/v1/agent/service/deregister/{member.id}")).raise_for_status()

            async def registered_again() -> bool:
                return member.id in (await http.get(f"{consul_url}/v1/agent/services")).json()

            await eventually_async(registered_again, timeout_s=10.0)
            await eventually_async(lambda: ids(view.members("cache")) == [member.id], timeout_s=10.0)
            assert agent.registered
        finally:
            await agent.aclose()
            await view.aclose()


async def test_maintenance_mode_takes_a_member_out_of_routing(consul_url: str, prefix: str) -> None:
    member = Member(f"{prefix}shard-m", "shard", "http://127.0.0.1:8102")
    async with consul_client() as http:
        live = ConsulMembership(consul_url, http, wait_s=5.0, service_prefix=prefix)
        every = ConsulMembership(consul_url, http, wait_s=5.0, service_prefix=prefix, passing_only=False)
        await live.start()
        await every.start()
        agent = ConsulRegistrationAgent(consul_url, member, http, ttl_s=1.0, service_prefix=prefix)
        try:
            await agent.start()
            await eventually_async(lambda: ids(live.members("shard")) == [member.id], timeout_s=2.0)
            maint = f"{consul_url}/v1/agent/service/maintenance/{member.id}"
            (await http.put(maint, params={"enable": "true", "reason": "test"})).raise_for_status()
            await eventually_async(lambda: live.members("shard") == [], timeout_s=2.0)
            await eventually_async(lambda: [m.status for m in every.all_members()] == ["draining"], timeout_s=2.0)
            (await http.put(maint, params={"enable": "false"})).raise_for_status()
            await eventually_async(lambda: ids(live.members("shard")) == [member.id], timeout_s=2.0)
        finally:
            await agent.aclose()
            await live.aclose()
            await every.aclose()


# -- stub only: Consul goes away ----------------------------------------------------------------


async def test_view_keeps_the_last_list_while_consul_is_down_and_recovers(prefix: str) -> None:
    stub = ConsulStub().start()
    member = Member(f"{prefix}shard-0", "shard", "http://127.0.0.1:8101")
    try:
        async with consul_client() as http:
            view = ConsulMembership(stub.membership_url, http, wait_s=2.0, service_prefix=prefix)
            await view.start()
            agent = ConsulRegistrationAgent(stub.membership_url, member, http, ttl_s=0.6, service_prefix=prefix)
            await agent.start()
            await eventually_async(lambda: ids(view.members("shard")) == [member.id], timeout_s=2.0)
            stub.stop()
            await eventually_async(lambda: not view.reachable, timeout_s=4.0)
            await eventually_async(lambda: not agent.registered, timeout_s=2.0)
            assert ids(view.members("shard")) == [member.id]  # routing goes on with the last list
            stub.start()  # a wiped agent: it knows nobody until heartbeats register them again
            await eventually_async(lambda: view.reachable and agent.registered, timeout_s=5.0)
            await eventually_async(lambda: ids(view.members("shard")) == [member.id], timeout_s=3.0)
            await agent.aclose()
            await view.aclose()
    finally:
        stub.stop()


async def test_stub_deregisters_services_critical_for_too_long(prefix: str) -> None:
    with ConsulStub() as stub:
        async with consul_client() as http:
            await register_raw(http, stub.url, f"{prefix}x", f"{prefix}shard", "300ms",
                               DeregisterCriticalServiceAfter="500ms")
            services = f"{stub.url}/v1/agent/services"
            assert f"{prefix}x" in (await http.get(services)).json()

            async def gone() -> bool:
                return f"{prefix}x" not in (await http.get(services)).json()

            await eventually_async(gone, timeout_s=3.0)


# -- a whole cluster on the stub ------------------------------------------------------------------


def chat(gateway: Service) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['plus']}"},
                      json={"model": "synthetic", "messages": [{"role": "user", "content": "hi there"}],
                            "max_tokens": 4})


def wait_metric(gateway: Service, name: str, value: float, timeout_s: float, **labels: str) -> float:
    return eventually(lambda: metric(gateway.url, name, **labels) == value, timeout_s,
                      what=f"{name}{labels} == {value}",
                      detail=lambda: f"it is {metric(gateway.url, name, **labels)}")


def test_cluster_on_consul_stub_routes_loses_a_shard_and_survives_consul_outage() -> None:
    stub = ConsulStub().start()
    membership = ["--membership", stub.membership_url]
    shards = [Service(["shard", "--engine", "synthetic", *membership, "--node-id", f"shard-{i}",
                       "--synthetic-token-delay-ms", "1"]) for i in range(2)]
    cache = Service(["cache-node", *membership, "--node-id", "cache-0"])
    gateway = Service(["gateway", *membership, "--tokenizer", "whitespace", "--model-name", "synthetic"],
                      env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
    procs = [*shards, cache, gateway]
    try:
        for p in [*shards, cache]:
            p.start(wait=False)
        for p in [*shards, cache]:
            p.wait_healthy()
        gateway.start()
        wait_metric(gateway, "switchboard_gateway_members", 2, 10.0, service="shard")
        wait_metric(gateway, "switchboard_gateway_members", 1, 5.0, service="cache")
        assert metric(gateway.url, "switchboard_membership_reachable") == 1
        registered = httpx.get(stub.url + "/v1/agent/services").json()
        assert {s["Service"] for s in registered.values()} == {
            "switchboard-shard", "switchboard-cache", "switchboard-gateway"}
        assert chat(gateway).status_code == 200

        shards[0].kill()  # kill -9: no deregistration; its 0.8 s TTL check must expire
        left = wait_metric(gateway, "switchboard_gateway_members", 1, 5.0, service="shard")
        assert left < 3.0
        checks = httpx.get(stub.url + "/v1/agent/checks").json()
        assert checks["service:shard-0"]["Status"] == "critical"
        assert all(chat(gateway).status_code == 200 for _ in range(4))

        stub.stop()  # Consul goes away: the gateway routes on what it saw last, and says so
        wait_metric(gateway, "switchboard_membership_reachable", 0, 10.0)
        assert metric(gateway.url, "switchboard_gateway_members", service="shard") == 1
        assert all(chat(gateway).status_code == 200 for _ in range(4))
    finally:
        for p in reversed(procs):
            p.stop()
        stub.stop()
