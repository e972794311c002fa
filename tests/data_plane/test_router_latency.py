"""Latency-aware routing (data_plane/routing/latency.py and the router's use of it), with a fake clock
and a seeded rng: the peak-EWMA estimate, power of two choices by latency x (outstanding + 1), sessions
leaving a clear latency outlier and coming back, the metrics. No processes.

    .venv/bin/python -m pytest tests/data_plane/test_router_latency.py -q       # < 1 s
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from data_plane.membership.view import Member, routable
from data_plane.routing.latency import LatencyConfig, ShardLatency
from data_plane.routing.router import Router, RouterMetrics
from tests.support.clock import FakeClock


def shard(mid: str) -> Member:
    return Member(mid, "shard", f"http://{mid}")


class Members:
    """A shard list the test changes (no ``subscribe``: the router reads it per decision)."""

    def __init__(self, members: tuple[Member, ...]) -> None:
        self.list = members

    def members(self, service: str) -> list[Member]:
        return routable(self.list, service)

    def set(self, members: list[Member]) -> None:
        self.list = tuple(members)


def router(*members: Member, **kw: object) -> tuple[Router, FakeClock, CollectorRegistry, Members]:
    registry, clock = CollectorRegistry(), FakeClock(1000.0)
    view = Members(members)
    r = Router(view, RouterMetrics(registry), rng=random.Random(7), clock=clock, **kw)  # type: ignore[arg-type]
    return r, clock, registry, view


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def warm(r: Router, clock: FakeClock, seconds: dict[str, float], rounds: int = 5) -> None:
    for _ in range(rounds):
        for mid, s in seconds.items():
            r.observe_latency(shard(mid), s)
        clock.advance(1.0)


# -- the estimate ---------------------------------------------------------------------------


def test_a_slow_sample_raises_the_estimate_at_once_and_fast_ones_bring_it_down_over_decay_s() -> None:
    clock = FakeClock(0.0)
    lat = ShardLatency(LatencyConfig(decay_s=10.0), clock)
    assert lat.estimate("a") is None
    lat.observe("a", 0.1)
    assert lat.estimate("a") == pytest.approx(0.1)
    clock.advance(1.0)
    lat.observe("a", 5.0)
    assert lat.estimate("a") == pytest.approx(5.0)  # the peak: at once
    for _ in range(10):
        clock.advance(1.0)
        lat.observe("a", 0.1)
    est = lat.estimate("a")
    assert est is not None and 0.1 < est < 5.0 * 0.4  # about e^-1 of the excess left after decay_s
    for _ in range(60):
        clock.advance(1.0)
        lat.observe("a", 0.1)
    assert lat.estimate("a") == pytest.approx(0.1, rel=0.01)


def test_read_without_samples_an_estimate_decays_toward_half_the_median_so_an_avoided_shard_is_tried_again() -> None:
    clock = FakeClock(0.0)
    lat = ShardLatency(LatencyConfig(decay_s=10.0), clock)
    for mid, s in (("b", 0.2), ("c", 0.2), ("a", 8.0)):
        lat.observe(mid, s)
    assert lat.median() == pytest.approx(0.2)
    clock.advance(10.0)
    assert lat.estimate("a") == pytest.approx(0.1 + 7.9 / 2.718281828, rel=1e-3)  # toward half the median
    assert lat.estimate("b") == pytest.approx(0.1 + 0.1 / 2.718281828, rel=1e-3)  # toward half its own
    clock.advance(100.0)
    assert lat.estimate("a") == pytest.approx(0.1, rel=1e-2) and lat.estimate("b") == pytest.approx(0.1, rel=1e-2)


def test_one_request_at_a_time_still_probes_a_shard_that_was_slow() -> None:
    """Sequential traffic (both shards at 0 outstanding at every decision): the formerly slow shard's
    estimate must come to undercut the one in use, or it never gets a sessionless request again."""
    a, b = shard("a"), shard("b")
    r, clock, _, _ = router(a, b)
    warm(r, clock, {"a": 0.2, "b": 0.2})
    r.observe_latency(a, 5.0)
    picks = []
    for _ in range(120):
        clock.advance(1.0)
        m = r.pick(None)
        picks.append(m.id)
        r.observe_latency(m, 0.2)
    assert picks[:20] == ["b"] * 20 and "a" in picks


def test_equally_fast_shards_idle_for_a_minute_share_the_next_burst() -> None:
    """Decayed toward 0 (Linkerd's read), the shard measured 30 s earlier came out of a quiet minute
    e^3 cheaper than the other, and a burst of 20 requests all went to it before any first token."""
    a, b = shard("a"), shard("b")
    r, clock, _, _ = router(a, b)
    r.observe_latency(a, 0.2)
    clock.advance(30.0)
    r.observe_latency(b, 0.2)
    clock.advance(60.0)
    leases = []
    for _ in range(20):  # concurrent: each holds its lease, no first token yet
        lease = r.lease(r.pick(None))
        lease.__enter__()
        leases.append(lease)
    assert sorted(r.fleet.loads.get(m, 0) for m in ("a", "b")) == [10, 10]
    for lease in leases:
        lease.__exit__(None, None, None)


def test_an_unmeasured_shard_costs_the_fleet_median_and_cost_grows_with_outstanding() -> None:
    clock = FakeClock(0.0)
    lat = ShardLatency(LatencyConfig(), clock)
    assert lat.cost("new", 0) == lat.cost("other", 0)  # nothing measured: all alike
    for mid, s in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
        lat.observe(mid, s)
    clock.advance(1.0)  # past refresh_s: the median snapshot is rebuilt
    median = lat.median()
    assert lat.cost("new", 0) == pytest.approx(median) and lat.estimate("b") == pytest.approx(median)
    assert lat.cost("a", 3) == pytest.approx(4 * lat.estimate("a"))  # type: ignore[operator]


def test_a_shard_that_left_leaves_the_median_at_once_and_is_forgotten_after_forget_s() -> None:
    clock = FakeClock(0.0)
    lat = ShardLatency(LatencyConfig(forget_s=60.0), clock)
    lat.observe("a", 0.1)
    lat.observe("b", 3.0)
    assert lat.keep_only({"a"}) == ["b"] and lat.median() == pytest.approx(0.1)
    clock.advance(5.0)
    lat.keep_only({"a", "b"})  # back (a slow shard's heartbeats lapsed): still known as slow
    assert lat.estimate("b") == pytest.approx(1.5 + 1.5 * 2.718281828 ** -0.5, rel=1e-3)  # toward half its own
    lat.keep_only({"a"})
    clock.advance(61.0)
    lat.median()
    assert len(lat) == 1 and lat.estimate("b") is None


# -- sessionless: power of two choices by latency x (outstanding + 1) -----------------------


def test_sessionless_requests_go_to_the_fast_shard_unless_it_is_far_more_loaded() -> None:
    a, b = shard("a"), shard("b")
    r, clock, _, _ = router(a, b)
    warm(r, clock, {"a": 0.1, "b": 2.0})
    assert Counter(r.pick(None).id for _ in range(40)) == Counter({"a": 40})
    leases = [r.lease(a) for _ in range(25)]  # 26 x 0.1 > 1 x 2.0: b is the cheaper now
    for lease in leases:
        lease.__enter__()
    assert r.pick(None).id == "b"
    for lease in leases:
        lease.__exit__(None, None, None)


def test_without_latency_awareness_power_of_two_choices_reads_outstanding_alone() -> None:
    a, b = shard("a"), shard("b")
    r, clock, _, _ = router(a, b, latency=LatencyConfig(enabled=False))
    warm(r, clock, {"a": 0.1, "b": 2.0})
    assert r.latency is None and {r.pick(None).id for _ in range(40)} == {"a", "b"}


def test_a_new_shard_is_treated_as_the_median_and_gets_traffic() -> None:
    a, b, c = shard("a"), shard("b"), shard("c")
    r, clock, _, view = router(a, b)
    warm(r, clock, {"a": 0.2, "b": 0.2})
    view.set([a, b, c])
    assert "c" in {r.pick(None).id for _ in range(60)}


# -- sessions: affinity, unless the shard is a clear latency outlier -------------------------


def _session_on(r: Router, mid: str) -> str:
    return next(s for s in (f"s-{i}" for i in range(1000)) if r.pick(s).id == mid)


def test_a_session_leaves_its_shard_only_when_it_is_a_clear_outlier_and_returns_when_it_is_fast() -> None:
    a, b, c = shard("a"), shard("b"), shard("c")
    r, clock, registry, _ = router(a, b, c)
    warm(r, clock, {"a": 0.2, "b": 0.2, "c": 0.2})
    sess = _session_on(r, "a")
    r.observe_latency(a, 1.5)  # one slow answer (a long prefill): affinity holds
    assert r.pick(sess).id == "a"
    assert sample(registry, "switchboard_router_latency_spills_total", reason="outlier") == 0
    clock.advance(1.0)
    r.observe_latency(a, 1.8)  # slow again: an outlier, 1.8 > 3 x 0.2 and > 1 s
    moved = r.pick(sess)
    assert moved.id != "a" and {r.pick(sess).id for _ in range(10)} == {moved.id}  # still one shard
    assert sample(registry, "switchboard_router_latency_spills_total", reason="outlier") == 11
    assert sample(registry, "switchboard_router_shard_latency_seconds", shard="a") == pytest.approx(1.8)
    for _ in range(30):  # a is fast again (its sessionless share measures it)
        clock.advance(1.0)
        r.observe_latency(a, 0.2)
        r.observe_latency(moved, 0.2)
    assert r.pick(sess).id == "a"


def test_an_avoided_slow_shard_gets_its_sessions_back_once_its_estimate_decays_then_leaves_again() -> None:
    a, b = shard("a"), shard("b")
    r, clock, _, _ = router(a, b, latency=LatencyConfig(decay_s=10.0))
    warm(r, clock, {"a": 0.2, "b": 0.2})
    sess = _session_on(r, "a")
    r.observe_latency(a, 5.0)
    clock.advance(1.0)
    r.observe_latency(a, 5.0)
    assert r.pick(sess).id == "b"
    for _ in range(25):  # no sample from a (it is avoided); b keeps answering fast
        clock.advance(1.0)
        r.observe_latency(b, 0.2)
    assert r.pick(sess).id == "a"  # decayed below 1 s: tried again (the probe)
    r.observe_latency(a, 4.0)  # still slow: left again at once
    assert r.pick(sess).id == "b"


def test_if_every_shard_is_slow_sessions_stay_put() -> None:
    a, b, c = shard("a"), shard("b"), shard("c")
    r, clock, registry, _ = router(a, b, c)
    warm(r, clock, {"a": 4.0, "b": 5.0, "c": 6.0})
    sessions = {s: r.pick(s).id for s in (f"s-{i}" for i in range(30))}
    assert len(set(sessions.values())) == 3
    warm(r, clock, {"a": 4.0, "b": 5.0, "c": 6.0})
    assert {s: r.pick(s).id for s in sessions} == sessions
    assert sample(registry, "switchboard_router_latency_spills_total", reason="outlier") == 0


def test_with_no_other_shard_in_routing_the_slow_one_serves_and_it_is_counted() -> None:
    a, b = shard("a"), shard("b")
    r, clock, registry, _ = router(a, b)
    warm(r, clock, {"a": 0.2, "b": 0.2})
    sess = _session_on(r, "a")
    r.observe_latency(a, 3.0)
    clock.advance(1.0)
    r.observe_latency(a, 3.0)
    assert r.pick(sess, exclude={"b"}).id == "a"
    assert sample(registry, "switchboard_router_latency_spills_total", reason="no_alternative") == 1


def test_a_shard_leaving_membership_drops_its_gauge_and_after_forget_s_its_estimate() -> None:
    a, b = shard("a"), shard("b")
    r, clock, registry, view = router(a, b)
    warm(r, clock, {"a": 0.2, "b": 0.3})
    assert sample(registry, "switchboard_router_shard_latency_seconds", shard="b") is not None
    view.set([a])
    r.pick(None)
    assert sample(registry, "switchboard_router_shard_latency_seconds", shard="b") is None
    clock.advance(61.0)
    r.observe_latency(a, 0.2)
    assert r.latency is not None and r.latency.estimate("b") is None and len(r.latency) == 1


@pytest.mark.parametrize("policy", ["affinity", "kv_aware"])
def test_both_session_policies_spill_a_slow_holder(policy: str) -> None:
    a, b, c = shard("a"), shard("b"), shard("c")
    r, clock, _, _ = router(a, b, c, policy=policy)
    warm(r, clock, {"a": 0.2, "b": 0.2, "c": 0.2})
    sess = _session_on(r, "a")
    r.observe_kv(sess, "a", 500)
    assert r.pick(sess).id == "a"
    r.observe_latency(a, 2.0)
    clock.advance(1.0)
    r.observe_latency(a, 2.0)
    assert r.pick(sess).id != "a"


def test_a_sample_from_a_shard_out_of_membership_is_not_kept() -> None:
    a, b = shard("a"), shard("b")
    r, _, registry, _ = router(a, b)
    r.observe_latency(shard("gone"), 2.0)  # a stream that outlived its shard's membership
    assert r.latency is not None and r.latency.estimate("gone") is None
    assert sample(registry, "switchboard_router_shard_latency_seconds", shard="gone") is None


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_the_gateway_refuses_a_spill_factor_that_makes_a_fast_shard_an_outlier(factor: float) -> None:
    """At 0.5 the faster of two shards (1.5 s against 2.0 s) was an outlier as well as the slower one, so every
    session's turn left its shard for the other: the gateway's --latency-spill-factor takes 0 or above 1."""
    from pydantic import ValidationError

    from data_plane.gateway.settings import GatewaySettings

    clock = FakeClock()
    latency = ShardLatency(LatencyConfig(spill_factor=0.5, refresh_s=0.0), clock=clock)
    for _ in range(3):
        latency.observe("a", 1.5)
        latency.observe("b", 2.0)
        clock.advance(0.01)
    assert latency.outlier("a") is not None and latency.outlier("b") is not None  # the ping-pong
    with pytest.raises(ValidationError, match="above 1"):
        GatewaySettings(latency_spill_factor=factor)
    assert GatewaySettings(latency_spill_factor=0).latency_spill_factor == 0
    assert GatewaySettings(latency_spill_factor=1.5).latency_spill_factor == 1.5
