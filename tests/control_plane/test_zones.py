"""Zone outage as a decision: ZoneWatch's rule, and the control plane seeing a real zone lose its shards.

    .venv/bin/python -m pytest tests/control_plane/test_zones.py -q      # ~10 s
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from control_plane.zones import ZoneMetrics, ZoneWatch, count_by_zone
from tests.support.cluster import ADMIN_TOKEN
from tests.support.metrics import scrape
from tests.support.procs import Service
from tests.support.waits import eventually

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Listing:
    """The member dicts a registry snapshot returns, set by the test (ZoneWatch's input)."""

    def __init__(self) -> None:
        self.members: list[dict[str, Any]] = []

    def snapshot(self, service: str | None = None) -> tuple[int, list[dict[str, Any]]]:
        return 0, list(self.members)


def member(mid: str, service: str, zone: str | None, status: str = "passing") -> dict[str, Any]:
    return {"id": mid, "service": service, "meta": {"zone": zone} if zone else {}, "status": status}


def test_a_zone_that_loses_every_shard_is_down_until_one_returns() -> None:
    listing, registry = Listing(), CollectorRegistry()
    clock = iter(range(100, 200))
    watch = ZoneWatch(listing, ZoneMetrics(registry), clock=lambda: float(next(clock)))
    listing.members = [member("s-a", "shard", "a"), member("c-a", "cache", "a"), member("s-b", "shard", "b"),
                       member("c-only", "cache", "c")]
    watch.tick()
    assert [z["state"] for z in watch.zones()] == ["up", "up", "no_shards"] and watch.events() == []
    listing.members = [member("s-a", "shard", "a", status="critical"), member("s-b", "shard", "b")]
    watch.tick()
    assert watch.down() == ["a"]
    (event,) = watch.events()
    assert event["zone"] == "a" and event["state"] == "down" and "no passing shard" in event["reason"]

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("switchboard_zone_up", zone="a") == 0 and value("switchboard_zone_up", zone="b") == 1
    assert value("switchboard_zone_up", zone="c") is None  # never had a shard: nothing to alert on
    assert value("switchboard_zone_members", service="cache", zone="a") == 0  # remembered at 0
    watch.tick()
    assert len(watch.events()) == 1  # no repeat while it stays down
    listing.members.append(member("s-a2", "shard", "a"))
    watch.tick()
    assert watch.down() == [] and watch.events()[-1]["state"] == "up"
    assert value("switchboard_zone_transitions_total", zone="a", state="down") == 1


async def test_a_drained_zone_is_not_an_outage_and_replacements_need_a_survivor() -> None:
    listing = Listing()
    watch = ZoneWatch(listing, ZoneMetrics(CollectorRegistry()))
    asked: list[tuple[str, int]] = []

    async def replace(zone: str, lost: int) -> None:
        asked.append((zone, lost))

    watch.on_down(replace)
    listing.members = [member("s-a", "shard", "a"), member("s-b", "shard", "b")]
    watch.tick()
    listing.members = [member("s-a", "shard", "a", status="draining"), member("s-b", "shard", "b")]
    watch.tick()
    listing.members = [member("s-b", "shard", "b")]  # the drained shard deregistered: a scale-in
    watch.tick()
    assert [z["state"] for z in watch.zones()] == ["drained", "up"] and watch.events() == [] and watch.down() == []
    listing.members = []  # zone b's shard dies: an outage, but no zone is left to put replacements in
    watch.tick()
    await asyncio.sleep(0)
    assert watch.down() == ["b"] and asked == []
    listing.members = [member("s-a2", "shard", "a"), member("s-b2", "shard", "b")]
    watch.tick()
    listing.members = [member("s-b2", "shard", "b")]  # a's shard vanishes while b is up
    watch.tick()
    await asyncio.sleep(0)
    assert watch.down() == ["a"] and asked == [("a", 1)]


def test_members_without_a_zone_count_as_local() -> None:
    assert count_by_zone([member("s", "shard", None)]) == {"local": {"shard": 1, "cache": 0, "gateway": 0}}


def test_control_plane_reports_a_real_zone_going_down() -> None:
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN]) as cp:
        shards = [Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", f"shard-{z}",
                           "--zone", z]) for z in ("a", "b")]
        try:
            for s in shards:
                s.start()
            eventually(lambda: _zones(cp, lambda body: [z["state"] for z in body["zones"]] == ["up", "up"]), 10,
                       what="zones a and b up")
            assert {z["zone"] for z in _zones(cp, bool)["zones"]} == {"a", "b"}
            members = httpx.get(cp.url + "/admin/v1/members", headers=AUTH).json()["members"]
            assert {m["zone"] for m in members} == {"a", "b"}
            shards[0].kill()  # no deregistration: the TTL check must notice
            took = eventually(lambda: _zones(cp, lambda body: body["down"] == ["a"]), 15, what="zone a down")
            down = _zones(cp, bool)
            print(f"zone a seen down {took:.2f} s after its shard was killed")
            assert down["events"][-1]["zone"] == "a" and down["events"][-1]["state"] == "down"
            metrics = scrape(cp.url)
            assert 'switchboard_zone_up{zone="a"} 0.0' in metrics and 'switchboard_zone_up{zone="b"} 1.0' in metrics
            assert httpx.get(cp.url + "/admin/v1/zones").status_code == 401
        finally:
            for s in shards:
                s.stop()


def _zones(cp: Service, ok: Any) -> dict[str, Any] | None:
    body = httpx.get(cp.url + "/admin/v1/zones", headers=AUTH).json()
    return body if ok(body) else None


def test_zone_for_new_shards_is_the_least_filled_live_zone() -> None:
    listing = Listing()
    watch = ZoneWatch(listing)
    listing.members = [member("s-a1", "shard", "a"), member("s-a2", "shard", "a"), member("s-b", "shard", "b")]
    watch.tick()
    assert watch.zone_for_new_shard() == "b"
    listing.members = [member("s-a1", "shard", "a")]  # b lost its shard: down
    watch.tick()
    assert watch.zone_for_new_shard() == "a"
    solo = ZoneWatch(Listing())
    solo._members.members = [member("s", "shard", None)]  # type: ignore[attr-defined]
    solo.tick()
    assert solo.zone_for_new_shard() is None  # one default zone: shards need no --zone


def test_autoscaled_shards_go_into_zones_that_have_only_caches_and_gateways_yet_spread_over_them() -> None:
    """Found with `switchboard up --zones a,b --autoscale --min-replicas 2`: zones a and b had cache nodes and
    gateways but no shard ("no_shards"), so no zone was "up", every autoscaled shard started in the default
    zone `local` (with no gateway or cache), and zones a and b never got one: each gateway always spilled,
    and a zone outage could not happen. Two shards asked for in one tick went to the same zone, too."""
    listing, now = Listing(), [100.0]
    watch = ZoneWatch(listing, clock=lambda: now[0])
    listing.members = [member("c-a", "cache", "a"), member("c-b", "cache", "b"), member("g-a", "gateway", "a"),
                       member("g-b", "gateway", "b")]
    watch.tick()
    assert [watch.zone_for_new_shard(), watch.zone_for_new_shard()] == ["a", "b"]  # one tick, two shards
    listing.members += [member("s-a", "shard", "a")]  # a's registered, b's still loading
    watch.tick()
    assert watch.zone_for_new_shard() == "a"  # b: 0 passing + 1 on its way
    now[0] += 200  # what was picked and never registered stops counting
    watch.tick()
    assert watch.zone_for_new_shard() == "b"
    listing.members = [m for m in listing.members if m["id"] != "s-a"]  # a lost its shard by accident: down
    watch.tick()
    assert {z["zone"]: z["state"] for z in watch.zones()}["a"] == "down"
    assert {watch.zone_for_new_shard() for _ in range(3)} == {"b"}
    empty = ZoneWatch(Listing())
    empty._members.members = [member("c", "cache", "a", status="critical")]  # type: ignore[attr-defined]
    empty.tick()
    assert empty.zone_for_new_shard() is None  # nothing alive in a: nowhere named to go
    # `up` starts the control plane, whose autoscaler starts --min-replicas shards at once, before any
    # cache node or gateway registered: the zones it was given (--shard-zones) take them
    early = ZoneWatch(Listing(), expected=("a", "b"))
    early.tick()
    assert [early.zone_for_new_shard() for _ in range(3)] == ["a", "b", "a"]


def test_autoscaler_replaces_a_lost_zone_in_the_surviving_one(tmp_path) -> None:
    """Real control plane, local actuator: zone a's shard dies -> a replacement starts in zone b."""
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--autoscale", "--min-replicas", "1",
                  "--max-replicas", "3", "--autoscale-interval-s", "0.5", "--scale-down-cooldown-s", "600",
                  "--shard-log-dir", str(tmp_path), "--shard-args", "--engine synthetic"]) as cp:
        zone_a = Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", "shard-a",
                          "--zone", "a"])
        zone_b = Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", "shard-b",
                          "--zone", "b"])
        try:
            zone_a.start()
            zone_b.start()

            def shards() -> list[dict[str, Any]]:
                listed = httpx.get(cp.url + "/admin/v1/members", headers=AUTH).json()["members"]
                return [m for m in listed if m["service"] == "shard" and m["status"] == "passing"]

            eventually(lambda: len(shards()) == 3, 30, what="the autoscaler's minimum shard beside a and b")
            local = [m for m in shards() if m["id"].startswith("shard-local-")]
            assert len(local) == 1  # its zone depends on whether a and b had registered by then
            zone_a.kill()
            eventually(lambda: any(d["code"] == "zone_down" for d in httpx.get(
                cp.url + "/admin/v1/decisions", headers=AUTH).json()["decisions"]), 15, what="a zone_down decision")
            decision = [d for d in httpx.get(cp.url + "/admin/v1/decisions", headers=AUTH).json()["decisions"]
                        if d["code"] == "zone_down"][-1]
            assert decision["action"] == "scale_up" and "zone a lost 1 shard" in decision["reason"]
            eventually(lambda: len([m for m in shards() if m["id"].startswith("shard-local-")]) == 2, 30,
                       what="the replacement serving")
            new = [m for m in shards() if m["id"].startswith("shard-local-") and m["id"] != local[0]["id"]]
            assert [m["zone"] for m in new] == ["b"]
        finally:
            zone_a.stop()
            zone_b.stop()
