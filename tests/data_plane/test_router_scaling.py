"""The router's incremental views (data_plane/routing/fleet.py): read once per membership change,
the same choices as rebuilding everything per request (ring, bounded loads, ejection, zones), and
the kv_aware index fed by shards' eviction reports (data_plane/routing/kv_routing.py). No processes."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from contextlib import ExitStack

from prometheus_client import CollectorRegistry

from data_plane.bench import route
from data_plane.common.kv_report import CHAIN_HEADER, EVICTED_HEADER, SINCE_HEADER, format_evicted
from data_plane.membership.hashring import HashRing
from data_plane.membership.placement import prefer_zone
from data_plane.membership.view import Member
from data_plane.routing.failures import FailureReason
from data_plane.routing.fleet import FastRing
from data_plane.routing.router import Router, RouterMetrics
from tests.support.clock import FakeClock


class View:
    """A membership view that notifies its subscribers, and counts how often it is read."""

    def __init__(self, ids: list[str], zones: dict[str, str] | None = None) -> None:
        self.zones = zones or {}
        self.reads = 0
        self._subscribers: list[Callable[[], None]] = []
        self.set(ids, notify=False)

    def set(self, ids: list[str], notify: bool = True) -> None:
        self._members = [Member(i, "shard", f"http://{i}", meta={"zone": self.zones.get(i, "local")}) for i in ids]
        if notify:
            for callback in self._subscribers:
                callback()

    def members(self, service: str) -> list[Member]:
        self.reads += 1
        return list(self._members)

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)


def make(view: View, policy: str = "affinity", **kw: object) -> tuple[Router, CollectorRegistry, FakeClock]:
    registry, clock = CollectorRegistry(), FakeClock(100.0)
    return Router(view, RouterMetrics(registry), policy=policy, rng=random.Random(3), clock=clock,
                  **kw), registry, clock  # type: ignore[arg-type]


def shard(i: str) -> Member:
    return Member(i, "shard", f"http://{i}")


IDS = [f"shard-{i}" for i in range(12)]


def test_a_membership_change_is_read_and_built_once() -> None:
    view = View(IDS[:8])
    r, _, _ = make(view)
    for i in range(200):
        r.pick(f"s-{i}")
    assert view.reads == 1 and r.fleet.changes == 1 and r.fleet.ring.builds == 1
    view.set(IDS[:9])                       # one shard joins
    for i in range(200):
        r.pick(f"s-{i}")
    assert view.reads == 2 and r.fleet.changes == 2
    assert r.fleet.ring.builds == 1 and r.fleet.ring.patches == 1   # patched in place, not rebuilt
    view.set(IDS[:9])                       # a notification without a change: nothing rebuilt
    r.pick("s-1")
    assert r.fleet.changes == 2 and r.fleet.ring.patches == 1


def test_the_patched_ring_walks_like_a_fresh_hash_ring() -> None:
    ring = FastRing()
    rnd = random.Random(5)
    nodes = set(IDS[:6])
    ring.update(nodes)
    for _ in range(6):
        nodes ^= {rnd.choice(IDS)}           # add or remove one node
        if nodes:
            ring.update(nodes)
        ref = HashRing(nodes)
        for k in range(60):
            assert list(ring.walk(f"k-{k}")) == list(ref.walk(f"k-{k}"))


def test_choices_match_a_per_request_rebuild_under_load_ejection_and_exclusion() -> None:
    view = View(IDS)
    r, _, clock = make(view, eject_after=2)
    rnd = random.Random(11)
    leases = ExitStack()
    for _ in range(40):                     # uneven outstanding load
        leases.enter_context(r.lease(shard(rnd.choice(IDS))))
    for _ in range(2):
        r.report_failure(shard("shard-4"), FailureReason.CONNECT)   # ejected
    for i in range(300):
        exclude = {rnd.choice(IDS)} if i % 3 == 0 else set()
        candidates = [m for m in IDS if m != "shard-4" and m not in exclude]
        loads = {m: r.load(m) for m in candidates}
        expected = HashRing(candidates).bounded_load_choice(f"s-{i}", loads, 0.25)
        assert r.pick(f"s-{i}", exclude).id == expected
    clock.now += 5.1                        # the ejection expires: exactly one probe, then routing
    assert r.pick("s-x").id == "shard-4"
    assert "shard-4" not in {r.pick(f"t-{i}").id for i in range(100)}
    r.report_success(shard("shard-4"))
    assert "shard-4" in {r.pick(f"t-{i}").id for i in range(100)}
    leases.close()
    assert r.fleet.total_load == 0 and not r.fleet.loads


def test_loads_of_a_shard_that_leaves_and_returns_stay_consistent() -> None:
    view = View(IDS[:4])
    r, _, _ = make(view)
    lease = r.lease(shard("shard-1"))
    lease.__enter__()
    view.set(["shard-0", "shard-2", "shard-3"])
    r.pick("s")
    assert r.fleet.total_load == 0
    view.set(IDS[:4])
    r.pick("s")
    assert r.fleet.total_load == 1
    lease.__exit__(None, None, None)
    assert r.fleet.total_load == 0 and r.fleet.zone_load == {"local": 0}


def test_zone_preference_is_the_same_rule_as_prefer_zone() -> None:
    zones = {i: ("a" if n % 3 else "b") for n, i in enumerate(IDS)}
    view = View(IDS, zones)
    r, registry, _ = make(view, zone="a")
    rnd = random.Random(2)
    for trial in range(40):
        leases = ExitStack()
        for _ in range(rnd.randrange(0, 40)):
            leases.enter_context(r.lease(shard(rnd.choice(IDS))))
        keep = prefer_zone({i: r.load(i) for i in IDS}, zones, "a", 0.25)
        picked = {r.pick(f"s-{trial}-{k}").id for k in range(30)}
        assert picked <= (keep or set(IDS)), (trial, keep, picked)
        if keep is None:
            assert any(zones[p] == "b" for p in picked) or not picked
        leases.close()
    assert (registry.get_sample_value("switchboard_router_zone_decisions_total", {"locality": "local"}) or 0) > 0


def outcomes(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in registry.collect() if m.name == "switchboard_router_kv_decisions"
            for s in m.samples if s.name.endswith("_total")}


def headers(values: dict[str, str]) -> Callable[[bytes], bytes | None]:
    return lambda name: values[name.decode()].encode() if name.decode() in values else None


def test_an_eviction_report_makes_the_index_forget_the_holder() -> None:
    view = View(IDS[:4])
    r, registry, _ = make(view, policy="kv_aware")
    reports = r.kv_reports
    assert reports is not None
    holder = r.pick("s-1").id
    r.observe_kv("s-1", holder, 1500, "00000000000000aa")
    assert reports.request_headers(holder) == {SINCE_HEADER: "0"}
    view.set([*IDS[:4], "shard-new"])       # scale out: the ring may move s-1, its KV stays
    assert r.pick("s-1").id == holder and outcomes(registry)["holder"] == 1
    other = next(i for i in IDS[:4] if i != holder)
    assert reports.read(other, headers({EVICTED_HEADER: format_evicted(3, ["00000000000000aa"])})) == 0
    assert reports.read(holder, headers({EVICTED_HEADER: format_evicted(7, ["00000000000000aa"])})) == 1
    assert reports.request_headers(holder) == {SINCE_HEADER: "7"}
    assert registry.get_sample_value("switchboard_router_kv_forgotten_total") == 1
    r.pick("s-1")
    assert outcomes(registry)["ring"] == 2   # the first turn, and now: no known KV, the ring decides
    assert reports.read(holder, headers({CHAIN_HEADER: "junk", EVICTED_HEADER: "x;y"})) == 0  # malformed: ignored


def test_a_gone_holder_hands_the_turn_to_the_previous_holder_when_cheaper() -> None:
    view = View(IDS[:3])
    r, registry, _ = make(view, policy="kv_aware")
    first = r.pick("s-1").id
    r.observe_kv("s-1", first, 900)
    second = next(i for i in IDS[:3] if i != first)
    r.observe_kv("s-1", second, 1100)       # the conversation moved (e.g. its shard was overloaded)
    assert r.pick("s-1").id == second and outcomes(registry)["holder"] == 1
    view.set([i for i in IDS[:3] if i != second])   # its shard dies
    assert r.pick("s-1").id == first       # the older prefix of the same conversation is still there
    assert outcomes(registry)["previous_holder"] == 1
    view.set([i for i in IDS[:3] if i not in (first, second)])
    r.pick("s-1")
    assert outcomes(registry)["holder_gone"] == 1


def test_bench_route_reports_each_size_against_the_smallest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "route.json"
    route.main(["--sizes", "10,200", "--requests", "300", "--repeats", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert {(r["policy"], r["shards"]) for r in data["rows"]} == {(p, n) for p in route.POLICIES for n in (10, 200)}
    assert all(r["ratio_to_smallest"] > 0 and r["membership_changes"] == 2 for r in data["rows"])


def test_a_holder_past_the_ring_cap_keeps_the_turn_while_its_cached_tokens_outweigh_its_load() -> None:
    view = View(IDS[:2])
    r, registry, _ = make(view, policy="kv_aware")
    holder = r.pick("s-1").id
    r.observe_kv("s-1", holder, 1500)
    leases = ExitStack()
    for _ in range(3):   # ring cap ceil(1.25 x 4 / 2) = 3: the ring alone would spill this turn
        leases.enter_context(r.lease(shard(holder)))
    assert r.pick("s-1").id == holder and outcomes(registry)["holder"] == 1
    for _ in range(9):   # 12 outstanding x 128 tokens > 1,500 cached: recomputing elsewhere is cheaper
        leases.enter_context(r.lease(shard(holder)))
    assert r.pick("s-1").id != holder and outcomes(registry)["holder_overloaded"] == 1
    leases.close()
