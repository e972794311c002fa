"""kv_aware routing (data_plane/routing/kv_routing.py) with a real Router over a static membership: a
session's turn goes where its KV is, unless that shard is overloaded or gone; without known KV
it is today's session affinity."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.kv_routing import KVIndex
from data_plane.routing.router import Router, RouterMetrics
from tests.support.metrics import scrape


class Fleet:
    """A membership whose shard list the test changes (scale out, a shard dies)."""

    def __init__(self, n: int) -> None:
        self.ids = [f"shard-{i}" for i in range(n)]

    def members(self, service: str) -> list[Member]:
        return StaticMembership([Member(i, "shard", f"http://{i}") for i in self.ids]).members(service)


def router(fleet: Fleet, policy: str = "kv_aware") -> tuple[Router, CollectorRegistry]:
    registry = CollectorRegistry()
    return Router(fleet, RouterMetrics(registry), policy=policy, rng=random.Random(7)), registry


def outcomes(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in registry.collect() if m.name == "switchboard_router_kv_decisions"
            for s in m.samples if s.name.endswith("_total")}


def test_without_known_kv_it_is_session_affinity() -> None:
    fleet = Fleet(4)
    kv, registry = router(fleet)
    aff, _ = router(fleet, "affinity")
    sessions = [f"s-{i}" for i in range(50)]
    assert [kv.pick(s).id for s in sessions] == [aff.pick(s).id for s in sessions]
    assert outcomes(registry) == {"ring": 50}


def test_turns_stay_with_their_kv_when_the_ring_moves_them() -> None:
    fleet = Fleet(3)
    r, registry = router(fleet)
    first = {s: r.pick(s).id for s in (f"s-{i}" for i in range(60))}
    for s, shard in first.items():
        r.observe_kv(s, shard, 1500)
    fleet.ids.append("shard-3")          # scale out: the ring now maps some sessions to shard-3
    aff, _ = router(fleet, "affinity")
    moved_by_ring = [s for s in first if aff.pick(s).id != first[s]]
    assert moved_by_ring, "the ring should remap some sessions"
    assert all(r.pick(s).id == first[s] for s in first)   # their KV did not move: neither do they
    assert outcomes(registry)["holder"] == 60


def test_a_dead_or_overloaded_holder_loses_the_turn() -> None:
    fleet = Fleet(3)
    r, registry = router(fleet)
    holder = r.pick("s-1").id
    r.observe_kv("s-1", holder, 200)
    other = next(i for i in fleet.ids if i != holder)
    leases = [r.lease(Member(holder, "shard", "")) for _ in range(6)]
    for lease in leases:   # six requests outstanding on the holder, none elsewhere
        lease.__enter__()
    r.observe_kv("s-2", holder, 200)
    assert r.pick("s-2").id != holder   # 6 x 128 tokens of load outweigh 200 cached tokens
    for lease in leases:
        lease.__exit__(None, None, None)
    assert outcomes(registry)["holder_overloaded"] == 1
    fleet.ids.remove(holder)            # the holder dies: the ring picks among the rest
    assert r.pick("s-1").id in fleet.ids and other in fleet.ids


def test_the_index_is_bounded() -> None:
    index = KVIndex(max_sessions=3)
    for i in range(5):
        index.record(f"s-{i}", "shard-0", i)
    assert len(index) == 3 and index.holder("s-0") is None and index.holder("s-4") == ("shard-0", 4)


def test_a_gateway_routes_session_turns_to_their_kv() -> None:
    import httpx

    from tests.support.cluster import Cluster
    from tests.support.metrics import metric

    with Cluster(shards=2, caches=1, gateway_args=["--routing-policy", "kv_aware"]) as c:
        headers = {"authorization": f"Bearer {c.keys['plus']}", "x-session-id": "new"}
        served = []
        for i in range(4):
            r = httpx.post(c.gateway.url + "/v1/chat/completions", headers=headers, timeout=30,
                           json={"messages": [{"role": "user", "content": f"turn {i}"}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            headers["x-session-id"] = r.headers["x-session-id"]
            served.append(sum(metric(s.url, "vllm:request_success_total") for s in c.shards[:1]))
        text = scrape(c.gateway.url)
        assert metric(c.gateway.url, "switchboard_router_kv_decisions_total", outcome="ring") == 1, text
        assert metric(c.gateway.url, "switchboard_router_kv_decisions_total", outcome="holder") == 3
        assert served in ([0, 0, 0, 0], [1, 2, 3, 4])   # every turn on the same shard
