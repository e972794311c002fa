"""The gateway's side of the abuse monitor (data_plane/gateway/abuse.py), on an injected clock."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.errors import AuthenticationError, PermissionDenied, RateLimited
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
    assert info.value.code == "abuse_throttled" and info.value.type == "rate_limit_error"  # not an RPM/TPM limit
    wait = int(info.value.response_headers()["Retry-After"])
    assert wait == 60  # 59.4 s, rounded up
    clock.now += wait
    guard.admit(who)  # served


class _Headers(dict):  # type: ignore[type-arg]
    def getlist(self, name: str) -> list[str]:
        return [self[name]] if name in self else []


class _Request:
    def __init__(self, authorization: str) -> None:
        self.headers = _Headers(authorization=authorization)
        self.client = type("Peer", (), {"host": "127.0.0.1"})()


class _Keys:
    def authenticate(self, authorization: str | None) -> Principal:
        if authorization != "Bearer sk-good":
            raise AuthenticationError("Incorrect API key provided")
        return Principal(key_id="k1", tenant="acme", tier="free")


def test_a_banned_address_still_serves_its_valid_keys_and_refuses_its_bad_ones() -> None:
    """Ten bad keys from 127.0.0.1, sent by someone holding no key at all, banned the address, and the ban
    came before the key lookup: every tenant of a `switchboard up` on loopback (or behind a NAT, or a proxy
    not in --trusted-proxies) was refused for ten minutes, and the attacker could renew it forever."""
    clock = Clock(1_000.0)
    guard = AbuseGuard(AbuseGuardMetrics(CollectorRegistry()), clock=clock)
    guard.apply({"actions": [{"subject_kind": "address", "subject": "127.0.0.1", "response": "ban",
                              "expires_at": 1_600.0, "reason": "failed authentications"}]})
    assert guard.authenticate(_Keys(), _Request("Bearer sk-good")).tenant == "acme"
    with pytest.raises(PermissionDenied) as info:
        guard.authenticate(_Keys(), _Request("Bearer sk-guess"))
    assert info.value.code == "address_banned" and int(info.value.response_headers()["Retry-After"]) == 600
    assert guard._failures == {"127.0.0.1": 1}  # counted: an address that keeps guessing stays banned
    clock.now = 1_601.0  # the ban over: a bad key is a plain 401, counted
    with pytest.raises(AuthenticationError):
        guard.authenticate(_Keys(), _Request("Bearer sk-guess"))
    assert guard._failures == {"127.0.0.1": 2}
