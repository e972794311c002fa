"""Zones: replica placement, local-first reads and the router's own-zone preference (no processes).

    .venv/bin/python -m pytest tests/data_plane/test_placement.py -q
"""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from data_plane.cache.client import SessionStore
from data_plane.membership.hashring import HashRing
from data_plane.membership.placement import DEFAULT_ZONE, local_first, prefer_zone, replicas_across_zones
from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.hop_client import HopPool
from data_plane.routing.router import Router, RouterMetrics

ZONES = {"a1": "a", "a2": "a", "a3": "a", "b1": "b", "b2": "b", "c1": "c"}


def test_paid_replicas_land_in_distinct_zones_for_every_key() -> None:
    ring = HashRing(ZONES)
    for i in range(500):
        got = replicas_across_zones(ring.walk(f"sess-{i}"), 2, ZONES)
        assert len(got) == 2 and ZONES[got[0]] != ZONES[got[1]], got
        three = replicas_across_zones(ring.walk(f"sess-{i}"), 3, ZONES)
        assert {ZONES[n] for n in three} == {"a", "b", "c"}
        assert three[:2] == got  # growing the factor keeps the existing copies


def test_placement_is_the_same_on_every_gateway_whatever_its_zone() -> None:
    ring = HashRing(ZONES)
    for i in range(200):
        key = f"sess-{i}"
        sets = {frozenset(replicas_across_zones(ring.walk(key), 2, ZONES, local=z)) for z in ("a", "b", "c", None)}
        assert len(sets) == 1


def test_more_replicas_than_zones_fill_in_ring_order() -> None:
    one_zone = {n: "a" for n in ("a1", "a2", "a3")}
    ring = HashRing(one_zone)
    walk = list(ring.walk("s"))
    assert replicas_across_zones(iter(walk), 2, one_zone) == walk[:2]  # as before zones existed
    assert replicas_across_zones(iter(walk), 5, one_zone) == walk
    assert replicas_across_zones(iter(walk), 0, one_zone) == []


def test_free_sessions_stay_in_the_gateway_zone() -> None:
    ring = HashRing(ZONES)
    for i in range(200):
        for zone in ("a", "b", "c"):
            (node,) = replicas_across_zones(ring.walk(f"f-{i}"), 1, ZONES, local=zone)
            assert ZONES[node] == zone
    assert replicas_across_zones(iter(["a1", "b1"]), 1, ZONES, local="z") == ["a1"]  # no node of mine


def test_local_first_keeps_the_set_and_puts_ours_first() -> None:
    assert local_first(["a1", "b1", "c1"], ZONES, "b") == ["b1", "a1", "c1"]
    assert local_first(["a1", "b1"], ZONES, "z") == ["a1", "b1"]


def test_prefer_zone_spills_only_past_the_slack() -> None:
    zone_of = {"a1": "a", "a2": "a", "b1": "b"}
    assert prefer_zone({"a1": 0, "a2": 0, "b1": 0}, zone_of, "a", 0.25) == {"a1", "a2"}
    assert prefer_zone({"a1": 1, "a2": 1, "b1": 0}, zone_of, "a", 0.25) == {"a1", "a2"}  # within +1
    assert prefer_zone({"a1": 5, "a2": 5, "b1": 1}, zone_of, "a", 0.25) is None        # 5 > 1.25 x 1 + 1
    assert prefer_zone({"b1": 0}, zone_of, "a", 0.25) is None                           # none of ours
    assert prefer_zone({"a1": 9}, zone_of, "a", 0.25) == {"a1"}                         # nowhere to spill


def shard(member_id: str, zone: str | None) -> Member:
    meta = {"zone": zone} if zone else {}
    return Member(member_id, "shard", f"http://127.0.0.1:1/{member_id}", meta=meta)


def test_router_prefers_its_zone_then_spills_then_goes_remote() -> None:
    registry = CollectorRegistry()
    view = StaticMembership([shard("a1", "a"), shard("a2", "a"), shard("b1", "b")])
    router = Router(view, RouterMetrics(registry), zone="a", rng=random.Random(1))
    picked = {router.pick(f"s-{i}").id for i in range(50)} | {router.pick(None).id for _ in range(50)}
    assert picked == {"a1", "a2"}
    leases = [router.lease(m) for m in view.members("shard") if m.zone == "a" for _ in range(4)]
    for lease in leases:
        lease.__enter__()
    assert "b1" in {router.pick(None).id for _ in range(30)}  # zone a at 4 each vs 0: spill
    for lease in leases:
        lease.__exit__(None, None, None)
    only_b = Router(StaticMembership([shard("b1", "b")]), RouterMetrics(CollectorRegistry()), zone="a")
    assert only_b.pick("s").id == "b1"

    def count(locality: str) -> float:
        return registry.get_sample_value("switchboard_router_zone_decisions_total", {"locality": locality}) or 0

    assert count("local") >= 100 and count("spill") >= 1


def test_router_without_zone_or_with_one_zone_ignores_zones() -> None:
    view = StaticMembership([shard("x1", None), shard("x2", None)])
    router = Router(view, RouterMetrics(CollectorRegistry()), zone=DEFAULT_ZONE, rng=random.Random(2))
    assert {router.pick(None).id for _ in range(40)} == {"x1", "x2"}
    assert view.members("shard")[0].zone == DEFAULT_ZONE


async def test_session_store_places_paid_replicas_across_zones_and_reads_ours_first() -> None:
    caches = [Member(n, "cache", f"http://127.0.0.1:1/{n}", meta={"zone": z}) for n, z in ZONES.items()]
    pool = HopPool()
    try:
        store_b = SessionStore(StaticMembership(caches), pool, zone="b")
        store_c = SessionStore(StaticMembership(caches), pool, zone="c")
        for i in range(100):
            paid_b = store_b.replicas_for(f"s-{i}", 2)
            paid_c = store_c.replicas_for(f"s-{i}", 2)
            assert {m.id for m in paid_b} == {m.id for m in paid_c} and len({m.zone for m in paid_b}) == 2
            if any(m.zone == "b" for m in paid_b):
                assert paid_b[0].zone == "b"  # the nearer copy is asked first
            assert store_b.replicas_for(f"s-{i}", 1)[0].zone == "b"
    finally:
        await pool.aclose()
