"""The registry of requests in flight by key digest (data_plane/gateway/revocation.py), without processes:
a revocation ends a request waiting inside an interruptible block at once (KeyRevoked, counted by stage),
one busy elsewhere at its next wait; other keys and other cancellations are left alone. The processes'
side (streams, 401s, the shard, the ledger) is tests/data_plane/test_key_revocation.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from data_plane.gateway.auth import KeyStore, key_digest
from data_plane.gateway.metrics import GatewayMetrics
from data_plane.gateway.revocation import InFlight, InFlightKeys, KeyRevoked, RevocableSource, Stage
from data_plane.membership.view import Member
from data_plane.routing.upstream import Delta, Event

A, B = "sk-unit-a-0001", "sk-unit-b-0002"
BOTH = KeyStore.from_env(f"{A}:acme:free,{B}:acme:free")
ONLY_B = KeyStore.from_env(f"{B}:acme:free")


def _registry() -> tuple[InFlightKeys, GatewayMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    return InFlightKeys(metrics.revoked), metrics, registry


def _ended(registry: CollectorRegistry, stage: Stage) -> float:
    return registry.get_sample_value("switchboard_gateway_requests_revoked_total", {"stage": stage.value}) or 0.0


async def _waiting(inflight: InFlightKeys, key: str, held: list[InFlight], forever: asyncio.Event) -> str:
    hold = inflight.hold(key_digest(key), "req-" + key[-4:])
    held.append(hold)
    try:
        with hold.interruptible(Stage.OPENING):
            await forever.wait()  # the admission queue, a shard's first token...
        return "done"
    finally:
        hold.release()


async def test_a_revoked_keys_waiting_request_ends_at_once_and_another_keys_does_not() -> None:
    inflight, _, registry = _registry()
    forever, held = asyncio.Event(), list[InFlight]()
    a = asyncio.create_task(_waiting(inflight, A, held, forever))
    b = asyncio.create_task(_waiting(inflight, B, held, forever))
    await asyncio.sleep(0.01)
    assert len(inflight) == 2
    assert inflight.reloaded(BOTH, ONLY_B) == 1
    with pytest.raises(KeyRevoked) as e:
        await asyncio.wait_for(a, 1)
    assert (e.value.status, e.value.code) == (401, "invalid_api_key") and "revoked" in e.value.message
    assert not b.done() and len(inflight) == 1
    assert _ended(registry, Stage.OPENING) == 1 and _ended(registry, Stage.REPLYING) == 0
    forever.set()
    assert await b == "done" and len(inflight) == 0


async def test_a_request_busy_elsewhere_meets_the_revocation_at_its_next_wait() -> None:
    inflight, _, _ = _registry()
    hold = inflight.hold(key_digest(A), "req-1")
    inflight.reloaded(BOTH, ONLY_B)  # not inside an interruptible block: nothing cancelled
    await asyncio.sleep(0)  # would raise CancelledError had the task been cancelled
    with pytest.raises(KeyRevoked), hold.interruptible(Stage.REPLYING):
        pytest.fail("entered after the revocation")
    hold.release()
    assert len(inflight) == 0


async def test_another_cancellation_passes_through_as_it_is() -> None:
    """The client leaving (DisconnectWatch) or the server stopping is not a revocation."""
    inflight, _, registry = _registry()
    forever, held = asyncio.Event(), list[InFlight]()
    a = asyncio.create_task(_waiting(inflight, A, held, forever))
    await asyncio.sleep(0.01)
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert _ended(registry, Stage.OPENING) == 0 and len(inflight) == 0


class _Slow:
    """A shard stream: a token every 10 ms, for ever, until closed."""

    member = Member(id="shard-0", service="shard", url="http://127.0.0.1:1")

    def __init__(self) -> None:
        self.closed = False

    async def batches(self) -> AsyncIterator[list[Event]]:
        while True:
            await asyncio.sleep(0.01)
            yield [Delta("tok")]

    def close(self) -> None:
        self.closed = True


async def test_a_revoked_reply_stops_between_tokens() -> None:
    inflight, _, registry = _registry()
    hold = inflight.hold(key_digest(A), "req-1")
    inner = _Slow()
    source = RevocableSource(inner, hold)
    got = 0

    async def read() -> None:
        nonlocal got
        try:
            async for _ in source.batches():
                got += 1
                if got == 3:  # busy with the batch (writing to a slow client): not cancelled, but
                    inflight.reloaded(BOTH, ONLY_B)
                    assert inner.closed  # the shard's work stops at once
        finally:
            source.close()

    with pytest.raises(KeyRevoked):
        await asyncio.wait_for(read(), 1)
    assert got == 3 and inner.closed and _ended(registry, Stage.REPLYING) == 1
