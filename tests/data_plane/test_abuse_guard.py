"""The gateway's side of the abuse monitor (data_plane/gateway/abuse.py), on an injected clock."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.errors import RateLimited
from data_plane.gateway.abuse import AbuseGuard, AbuseGuardMetrics
from data_plane.gateway.auth import Principal


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_throttled_key_retrying_at_retry_after_is_served_not_refused_again() -> None:
    """Retry-After was the wait rounded to the nearest second: 59.4 s said "59", and the openai SDK, which
    waits exactly that, came back 0.4 s early to another 429 (and gave up after its two retries)."""
    clock = Clock(1_000.0)
    guard = AbuseGuard(AbuseGuardMetrics(CollectorRegistry()), clock=clock)
    guard.apply({"throttle_rpm": 1, "actions": [
        {"subject_kind": "key", "subject": "k1", "response": "throttle", "expires_at": 10_000.0, "reason": "burst"}]})
    who = Principal(key_id="k1", tenant="acme", tier="free")
    guard.admit(who)
    clock.now += 0.6
    with pytest.raises(RateLimited) as info:
        guard.admit(who)
    assert info.value.code == "abuse_throttled"
    wait = int(info.value.response_headers()["Retry-After"])
    assert wait == 60  # 59.4 s, rounded up
    clock.now += wait
    guard.admit(who)  # served
