"""The router on its own (data_plane/routing/router.py), with a fake clock and a seeded rng:
ejection after consecutive failures, the half-open probe and its doubling hold, bounded loads on
the session ring, zone preference and spill, lease counting. No processes.

    .venv/bin/python -m pytest tests/data_plane/test_router.py -q       # < 1 s
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.errors import NoHealthyBackend
from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.failures import FailureReason
from data_plane.routing.router import Router, RouterMetrics
from tests.support.clock import FakeClock


def shard(mid: str, zone: str | None = None) -> Member:
    return Member(mid, "shard", f"http://{mid}", meta={"zone": zone} if zone else {})


def router(*members: Member, **kw: object) -> tuple[Router, FakeClock, CollectorRegistry]:
    registry, clock = CollectorRegistry(), FakeClock(1000.0)
    r = Router(StaticMembership(members), RouterMetrics(registry), rng=random.Random(7), clock=clock,
               **kw)  # type: ignore[arg-type]
    return r, clock, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def picks(r: Router, n: int = 40, session: str | None = None) -> set[str]:
    return {r.pick(session).id for _ in range(n)}


# -- ejection -------------------------------------------------------------------------------


def test_a_shard_is_ejected_after_eject_after_consecutive_failures_only() -> None:
    a, b = shard("a"), shard("b")
    r, _, registry = router(a, b, eject_after=3)
    r.report_failure(a, FailureReason.CONNECT)
    r.report_failure(a, FailureReason.CONNECT)
    assert picks(r) == {"a", "b"} and not r.is_ejected("a")  # two failures: still routed
    r.report_success(a)  # a success resets the streak
    r.report_failure(a, FailureReason.CONNECT)
    r.report_failure(a, FailureReason.CONNECT)
    assert not r.is_ejected("a")
    r.report_failure(a, FailureReason.TIMEOUT)
    assert r.is_ejected("a") and picks(r) == {"b"}
    assert sample(registry, "switchboard_router_ejections_total", reason="consecutive") == 1
    assert sample(registry, "switchboard_router_upstream_failures_total", reason="connect") == 4
    assert sample(registry, "switchboard_router_shards", state="ejected") == 1
    assert sample(registry, "switchboard_router_shards", state="healthy") == 1


def test_with_every_shard_ejected_and_none_due_a_pick_is_no_healthy_backend() -> None:
    a, b = shard("a"), shard("b")
    r, _, _ = router(a, b, eject_after=1)
    r.report_failure(a, FailureReason.CONNECT)
    r.report_failure(b, FailureReason.CONNECT)
    with pytest.raises(NoHealthyBackend):
        r.pick(None)
    r2, _, _ = router(a, b)
    with pytest.raises(NoHealthyBackend):  # excluded (already tried) counts too
        r2.pick(None, exclude={"a", "b"})
    assert r2.pick(None, exclude={"a"}).id == "b"


# -- half-open probe ------------------------------------------------------------------------


def test_when_the_hold_expires_the_shard_gets_exactly_one_probe_and_success_restores_it() -> None:
    a, b = shard("a"), shard("b")
    r, clock, registry = router(a, b, eject_after=1, eject_s=5.0)
    r.report_failure(a, FailureReason.CONNECT)
    clock.now += 4.9
    assert picks(r) == {"b"}  # still held
    clock.now += 0.2
    assert r.pick(None).id == "a"  # the probe
    assert sample(registry, "switchboard_router_decisions_total", policy="probe") == 1
    assert picks(r) == {"b"}  # while the probe is in flight nothing else goes to a
    r.report_success(a)
    assert not r.is_ejected("a") and picks(r) == {"a", "b"}


def test_a_failed_probe_ejects_again_for_twice_as_long_capped_at_max_eject_s() -> None:
    a, b = shard("a"), shard("b")
    r, clock, registry = router(a, b, eject_after=1, eject_s=5.0, max_eject_s=12.0)
    r.report_failure(a, FailureReason.CONNECT)
    holds = []
    for _ in range(3):
        start = clock.now
        while r.pick(None).id != "a":  # advance until the probe is handed out
            clock.now += 0.5
            assert clock.now - start < 60
        holds.append(clock.now - start)
        r.report_failure(a, FailureReason.CONNECT)  # the probe fails
    assert holds == [5.0, 10.0, 12.0]
    assert sample(registry, "switchboard_router_ejections_total", reason="consecutive") == 1
    assert sample(registry, "switchboard_router_ejections_total", reason="probe") == 3


# -- bounded loads --------------------------------------------------------------------------


def test_a_session_stays_on_its_ring_shard_until_that_shard_passes_the_load_cap() -> None:
    a, b = shard("a"), shard("b")
    r, _, _ = router(a, b, epsilon=0.25)
    home = r.pick("sess-1")
    other = b if home.id == "a" else a
    assert {r.pick("sess-1").id for _ in range(10)} == {home.id}  # affinity
    with r.lease(home):
        # 1 outstanding of 2 shards: cap = ceil(1.25 * 2 / 2) = 2, so home (1 + 1) still fits
        assert r.pick("sess-1").id == home.id
        with r.lease(home):
            # 2 outstanding: cap = ceil(1.25 * 3 / 2) = 2, home would be at 3
            assert r.pick("sess-1").id == other.id
    assert r.pick("sess-1").id == home.id


def test_without_a_session_the_less_loaded_of_two_is_taken() -> None:
    a, b = shard("a"), shard("b")
    r, _, _ = router(a, b)
    with r.lease(a), r.lease(a):
        assert picks(r, 20) == {"b"}


# -- leases ---------------------------------------------------------------------------------


def test_a_lease_counts_one_outstanding_request_and_is_released_on_error() -> None:
    a = shard("a")
    r, _, registry = router(a)
    with r.lease(a):
        with r.lease(a):
            assert r.load("a") == 2
            assert sample(registry, "switchboard_router_outstanding_requests") == 2
        assert r.load("a") == 1
    with pytest.raises(RuntimeError), r.lease(a):
        raise RuntimeError("the call failed")
    assert r.load("a") == 0 and sample(registry, "switchboard_router_outstanding_requests") == 0


# -- zones ----------------------------------------------------------------------------------


def test_a_zoned_router_prefers_its_zone_spills_when_loaded_and_leaves_when_it_is_empty() -> None:
    a1, b1 = shard("a1", "a"), shard("b1", "b")
    r, _, registry = router(a1, b1, zone="a", zone_slack=0.25, eject_after=1)
    assert picks(r, 20) == {"a1"} and picks(r, 5, "sess-x") == {"a1"}
    assert sample(registry, "switchboard_router_zone_decisions_total", locality="local") == 25
    with r.lease(a1):  # local mean 1 is not past (1 + 0.25) * 0 + 1
        assert r.pick(None).id == "a1"
        with r.lease(a1):  # 2 > 1: spill to all zones, where b1 is the less loaded
            assert r.pick(None).id == "b1"
            assert sample(registry, "switchboard_router_zone_decisions_total", locality="spill") == 1
    r.report_failure(a1, FailureReason.CONNECT)  # the own zone has no healthy shard left
    assert picks(r, 10) == {"b1"}
    assert sample(registry, "switchboard_router_zone_decisions_total", locality="remote") == 10


def test_without_a_zone_the_router_ignores_zones() -> None:
    r, _, registry = router(shard("a1", "a"), shard("b1", "b"))
    assert picks(r) == {"a1", "b1"}
    assert sample(registry, "switchboard_router_zone_decisions_total", locality="local") == 0
