"""Tenant headroom inside a tier: while two tenants of a tier are active, one with a request in flight
leaves the tier's last slot to a tenant with none, so a light tenant never waits for a flood's
request to finish; a tenant alone in its tier uses the whole share, and the rule lapses after the window.

    .venv/bin/python -m pytest tests/data_plane/test_admission_headroom.py -q     # < 1 s

The Admission object is built directly with a fake clock; nothing runs but asyncio.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from data_plane.gateway.admission import Admission, AdmissionConfig, AdmissionMetrics, Ticket
from data_plane.tiers import TierPolicy
from tests.support.clock import FakeClock

POLICY = TierPolicy.default()
ENT = POLICY["enterprise"]


def admission(capacity: int, **config: object) -> tuple[Admission, FakeClock]:
    clock = FakeClock(0.0)
    adm = Admission(AdmissionMetrics(CollectorRegistry()), AdmissionConfig(reserve=0.0, **config),  # type: ignore[arg-type]
                    capacity=lambda: capacity, clock=clock)
    return adm, clock


async def fill(adm: Admission, tenant: str, n: int) -> tuple[list[Ticket], list[asyncio.Task[Ticket]]]:
    """Ask for `n` slots for `tenant`: the tickets granted at once, and the requests left waiting."""
    tasks = [asyncio.create_task(adm.acquire(ENT, POLICY, tenant=tenant)) for _ in range(n)]
    for _ in range(5):
        await asyncio.sleep(0)
    return [t.result() for t in tasks if t.done()], [t for t in tasks if not t.done()]


async def test_a_flood_leaves_the_last_slot_to_a_light_tenant_of_its_tier() -> None:
    adm, clock = admission(4)
    light = await adm.acquire(ENT, POLICY, tenant="light")  # the light tenant was here first
    light.release(10)
    held, waiting = await fill(adm, "flood", 6)
    assert len(held) == 3 and len(waiting) == 3  # 4 slots, the last kept free
    ticket = await asyncio.wait_for(adm.acquire(ENT, POLICY, tenant="light"), 0.1)  # no wait at all
    assert adm.inflight == 4
    ticket.release(10)
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(t.done() for t in waiting) == 0  # the freed slot is headroom again, not the flood's
    held[0].release(10)
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(t.done() for t in waiting) == 1  # a slot of the flood's own share goes back to it
    clock.now += 31  # the light tenant has been quiet for longer than the window
    held[1].release(10)
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(t.done() for t in waiting) == 3  # alone in its tier: the whole share
    for t in [*held[2:], *(t.result() for t in waiting)]:
        t.release(10)
    assert adm.inflight == 0


async def test_a_tenant_alone_in_its_tier_uses_every_slot() -> None:
    adm, _ = admission(4)
    held, waiting = await fill(adm, "only", 4)
    assert len(held) == 4 and not waiting


async def test_a_waiting_light_tenant_is_admitted_into_the_headroom_before_the_flood() -> None:
    adm, _ = admission(2)
    first = await adm.acquire(ENT, POLICY, tenant="light")
    held, flood_waiting = await fill(adm, "flood", 3)  # 1 slot left, kept for the light tenant's next
    assert len(held) == 1 and len(flood_waiting) == 2
    first.release(10)  # the light tenant's slot frees: the flood may not take it (headroom)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not any(t.done() for t in flood_waiting)
    light = await asyncio.wait_for(adm.acquire(ENT, POLICY, tenant="light"), 0.1)
    light.release(10)
    held[0].release(10)
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(t.done() for t in flood_waiting) == 1


async def test_headroom_off_lets_the_flood_take_every_slot() -> None:
    adm, _ = admission(4, tenant_headroom=0)
    (await adm.acquire(ENT, POLICY, tenant="light")).release(10)
    held, waiting = await fill(adm, "flood", 5)
    assert len(held) == 4 and len(waiting) == 1
