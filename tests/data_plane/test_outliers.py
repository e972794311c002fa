"""Failure-percentage outlier detection in the router (data_plane/routing/outliers.py), with a fake
clock: a shard failing every other call is ejected though its failures are never consecutive; the
request volume, the window, the max ejection percent and the reasons that do not count. No processes.

    .venv/bin/python -m pytest tests/data_plane/test_outliers.py -q       # < 1 s
"""

from __future__ import annotations

import pytest

from data_plane.membership.view import Member
from data_plane.routing.failures import FailureReason
from data_plane.routing.outliers import OutlierConfig
from data_plane.routing.router import Router
from tests.data_plane.test_router import picks, router, sample, shard

CFG = OutlierConfig(threshold=50, request_volume=10, window_s=10.0, minimum_hosts=2, max_ejection_percent=50)


def alternate(r: Router, member: Member, n: int, reason: FailureReason = FailureReason.CONNECT) -> None:
    """`n` calls on `member`, every other one failed with `reason` (none in a row); none once it is ejected
    (nothing is routed to it then)."""
    for i in range(n):
        if r.is_ejected(member.id):
            return
        if i % 2:
            r.report_failure(member, reason)
        else:
            r.report_success(member)


def test_a_shard_failing_every_other_call_is_ejected_by_its_failure_percentage() -> None:
    a, b = shard("a"), shard("b")
    r, clock, registry = router(a, b, eject_after=3, eject_s=5.0, outliers=CFG)
    alternate(r, a, 9)
    assert not r.is_ejected("a")  # 9 calls: under the request volume
    alternate(r, a, 2)  # 11 calls, 5 failed... then the 6th failure of 12
    r.report_failure(a, FailureReason.TIMEOUT)
    assert r.is_ejected("a") and picks(r) == {"b"}
    assert sample(registry, "switchboard_router_ejections_total", reason="failure_percentage") == 1
    assert sample(registry, "switchboard_router_ejections_total", reason="consecutive") == 0
    clock.now += 5.1
    assert r.pick(None).id == "a"  # the probe after the hold
    r.report_success(a)
    assert not r.is_ejected("a")
    alternate(r, a, 4)  # a fresh window: four calls are no volume
    assert not r.is_ejected("a")


def test_without_the_outlier_detection_consecutive_counting_never_ejects_it() -> None:
    a, b = shard("a"), shard("b")
    r, _, _ = router(a, b, eject_after=3, outliers=OutlierConfig(threshold=0))
    alternate(r, a, 200)
    assert not r.is_ejected("a")


def test_sparse_failures_and_old_failures_do_not_eject() -> None:
    a, b = shard("a"), shard("b")
    r, clock, _ = router(a, b, outliers=CFG)
    for i in range(300):  # one call in ten fails: well under 50 %
        clock.now += 0.05
        if i % 10 == 0:
            r.report_failure(a, FailureReason.STATUS_503)
        else:
            r.report_success(a)
    assert not r.is_ejected("a")
    # failures spread thinner than the request volume per window: no load, no ejection
    r2, clock2, _ = router(a, b, outliers=CFG)
    for _ in range(40):
        clock2.now += 3.0
        r2.report_failure(a, FailureReason.CONNECT)
        r2.report_success(a)
    assert not r2.is_ejected("a")


@pytest.mark.parametrize("reason", [FailureReason.STATUS_429, FailureReason.STATUS_503, FailureReason.MEMBERSHIP_LOST,
                                    FailureReason.REFUSED])
def test_backpressure_and_non_link_failures_are_not_held_against_the_percentage(reason: FailureReason) -> None:
    a, b = shard("a"), shard("b")
    r, _, registry = router(a, b, eject_after=3, outliers=CFG)
    alternate(r, a, 100, reason=reason)
    assert not r.is_ejected("a")
    assert sample(registry, "switchboard_router_ejections_total", reason="failure_percentage") == 0


def test_the_max_ejection_percent_keeps_shards_in_routing_and_never_the_last() -> None:
    a, b, c, d = shard("a"), shard("b"), shard("c"), shard("d")
    r, _, registry = router(a, b, c, d, eject_after=3, outliers=CFG)
    for m in (a, b, c, d):  # every shard's link is lossy: half of four may go, two stay
        alternate(r, m, 30)
    assert sum(r.is_ejected(m.id) for m in (a, b, c, d)) == 2
    assert sample(registry, "switchboard_router_ejections_total", reason="failure_percentage") == 2
    r2, _, _ = router(a, b, eject_after=3, outliers=OutlierConfig(threshold=50, request_volume=10,
                                                                   max_ejection_percent=100))
    alternate(r2, a, 30)
    alternate(r2, b, 30)
    assert [r2.is_ejected("a"), r2.is_ejected("b")].count(True) == 1  # never the last one in routing
    r3, _, _ = router(a, eject_after=3, outliers=CFG)  # one shard: below minimum_hosts
    alternate(r3, a, 30)
    assert not r3.is_ejected("a")
