"""Priority admission: order, per-tier reserve, deadlines, shedding order, no leaked slots.

    .venv/bin/python -m pytest tests/data_plane/test_admission.py -q     # ~2 s

The Admission object is built directly with a fresh registry; nothing runs but asyncio.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.errors import Overloaded
from data_plane.gateway.admission import Admission, AdmissionConfig, AdmissionMetrics, Ticket, shard_capacity
from data_plane.gateway.slot_wait import SlotHolds
from data_plane.tiers import TierPolicy

POLICY = TierPolicy.default()
FREE, PLUS, ENT = POLICY["free"], POLICY["plus"], POLICY["enterprise"]


def admission(capacity: int | None, **config: object) -> tuple[Admission, CollectorRegistry]:
    registry = CollectorRegistry()
    cap = {"value": capacity}
    adm = Admission(AdmissionMetrics(registry), AdmissionConfig(**config),  # type: ignore[arg-type]
                    capacity=lambda: cap["value"])
    return adm, registry


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiters_are_served_by_priority_then_arrival() -> None:
    adm, registry = admission(1, reserve=0.0)
    held = await adm.acquire(FREE, POLICY)
    order: list[str] = []

    async def one(name: str, tier) -> None:  # type: ignore[no-untyped-def]
        ticket = await adm.acquire(tier, POLICY)
        order.append(name)
        await asyncio.sleep(0)
        ticket.release()

    tasks = []
    for name, tier in [("free-1", FREE), ("plus-1", PLUS), ("enterprise", ENT), ("free-2", FREE), ("plus-2", PLUS)]:
        tasks.append(asyncio.create_task(one(name, tier)))
        await settle()
    assert adm.waiting == 5 and registry.get_sample_value("switchboard_admission_queue_depth", {"tier": "free"}) == 2
    held.release()
    await asyncio.gather(*tasks)
    assert order == ["enterprise", "plus-1", "plus-2", "free-1", "free-2"]
    assert adm.inflight == 0 and adm.waiting == 0
    assert registry.get_sample_value("switchboard_admission_wait_seconds_count", {"tier": "free"}) == 3


async def test_lower_tiers_leave_a_reserve_for_higher_ones() -> None:
    adm, _ = admission(16)  # reserve 0.125 per level: free may fill 12, plus 14, enterprise 16
    assert [adm.cap(rank, 16) for rank in (2, 1, 0)] == [12, 14, 16]
    free = [await adm.acquire(FREE, POLICY) for _ in range(12)]
    blocked = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    assert not blocked.done()
    plus = [await adm.acquire(PLUS, POLICY) for _ in range(2)]
    ent = [await adm.acquire(ENT, POLICY) for _ in range(2)]  # at once, though free is waiting
    assert adm.inflight == 16 and not blocked.done()
    for t in plus + ent:
        t.release()
    await settle()
    assert not blocked.done()  # 12 in flight: still free's cap
    free[0].release()
    (await blocked).release()
    for t in free[1:]:
        t.release()
    assert adm.inflight == 0


async def test_a_request_holds_a_slot_per_choice_so_n_cannot_fill_the_reserve() -> None:
    """A free key's requests with n=8 were each counted as one slot while the shard decoded eight sequences:
    three of them held 24 of 16 batch slots, and an enterprise request waited ~10 s for its first token."""
    adm, registry = admission(16)  # free may fill 12 of 16
    first = await adm.acquire(FREE, POLICY, tenant="a", slots=8)
    assert adm.inflight == 8 and registry.get_sample_value("switchboard_admission_inflight") == 8
    second = asyncio.create_task(adm.acquire(FREE, POLICY, tenant="a", slots=8))
    await settle()
    assert not second.done()  # 8 + 8 > free's 12
    one = await adm.acquire(FREE, POLICY, tenant="b")  # the least served tenant, and one slot fits
    ent = [await adm.acquire(ENT, POLICY, slots=2) for _ in range(3)]  # the reserve is there for enterprise
    assert adm.inflight == 15 and not second.done()
    for t in ent:
        t.release()
    one.release()
    await settle()
    assert not second.done()  # 8 in flight: 8 more would pass free's 12
    first.release()
    held = await second
    assert adm.inflight == 8
    held.release()
    assert adm.inflight == 0 and adm.waiting == 0


async def test_a_request_asking_more_slots_than_its_tier_may_fill_takes_all_of_it() -> None:
    adm, _ = admission(4)  # free may fill 3
    big = await adm.acquire(FREE, POLICY, slots=8)
    assert adm.inflight == 3  # at most the tier's cap, so it never waits for slots that cannot exist
    blocked = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    assert not blocked.done()
    big.release()
    (await blocked).release()
    assert adm.inflight == 0


async def test_a_waiter_past_its_deadline_is_shed_with_503_and_retry_after() -> None:
    adm, registry = admission(1, queue_timeouts={"free": 0.05})
    held = await adm.acquire(ENT, POLICY)
    with pytest.raises(Overloaded) as info:
        await adm.acquire(FREE, POLICY)
    err = info.value
    assert err.status == 503 and err.code == "overloaded"
    assert err.response_headers()["Retry-After"] == "1"  # the slot held ~0.05 s so far: a short wait
    assert registry.get_sample_value("switchboard_admission_shed_total", {"tier": "free", "reason": "deadline"}) == 1
    assert adm.waiting == 0
    held.release()
    assert adm.inflight == 0


async def test_retry_after_estimates_when_a_slot_frees_from_the_hold_times() -> None:
    """Retry-After was a fixed 2 s: in a burst whose requests held every slot ~23 s, a client retrying after 2 s
    queued and was shed again, and the openai SDK gave up after its retries (~21 s) with the slots still busy."""
    now = {"t": 0.0}
    adm = Admission(AdmissionMetrics(CollectorRegistry()), AdmissionConfig(reserve=0.0, queue_size=1),
                    capacity=lambda: 2, clock=lambda: now["t"])

    async def shed_after_a_queued_one() -> tuple[float, asyncio.Task[Ticket]]:
        queued = asyncio.create_task(adm.acquire(FREE, POLICY, tenant="a"))
        await settle()
        with pytest.raises(Overloaded) as info:  # the queue (1) is full: the newcomer is shed
            await adm.acquire(FREE, POLICY, tenant="a")
        return float(info.value.response_headers()["Retry-After"]), queued

    burst = [await adm.acquire(ENT, POLICY) for _ in range(2)]
    now["t"] = 5.0
    retry, queued = await shed_after_a_queued_one()
    # no hold completed yet: both slots taken 5 s ago, each assumed to last as long again; the shed one needs
    # both to free (the queued one goes first)
    assert retry == 5
    now["t"] = 23.0
    for t in burst:
        t.release()
    ticket = await queued
    now["t"] = 46.0
    ticket.release()  # three 23 s holds are the history now
    burst = [await adm.acquire(ENT, POLICY) for _ in range(2)]
    now["t"] = 51.0
    retry, queued = await shed_after_a_queued_one()
    assert retry == 18  # 23 s holds, 5 s in: 18 s left
    now["t"] = 200.0  # far past the history: the ages say they last as long again, at most 60 s
    with pytest.raises(Overloaded) as info:
        await adm.acquire(FREE, POLICY, tenant="b")
    assert info.value.response_headers()["Retry-After"] == "60"
    for t in burst:
        t.release()
    (await queued).release()
    quick = await adm.acquire(ENT, POLICY)  # a short request while another is queued: a short wait
    other = await adm.acquire(ENT, POLICY)
    now["t"] = 200.5
    quick.release()
    other.release()
    for _ in range(20):  # the history turns short
        t = await adm.acquire(ENT, POLICY)
        now["t"] += 0.3
        t.release()
    held = [await adm.acquire(ENT, POLICY) for _ in range(2)]
    now["t"] += 0.1
    retry, queued = await shed_after_a_queued_one()
    assert retry == 1
    for t in held:
        t.release()
    (await queued).release()
    assert adm.inflight == 0 and adm.waiting == 0


def test_slot_holds_count_slots_per_request_and_rounds_past_the_slots_in_flight() -> None:
    holds = SlotHolds(min_s=1.0, max_s=60.0)
    assert holds.wait_s(3, now=0.0) == 1.0  # nothing in flight: the least
    for i in range(3):  # three 10 s holds: the history
        holds.start(i, 0.0, 1)
        holds.end(i, 10.0)
    holds.start(10, 10.0, 2)  # two slots (n=2), taken at 10 s
    holds.start(11, 14.0, 1)
    # at 16 s: mean age (6*2 + 2) / 3 = 4.67, so the hold is the history's 10 s; the n=2 request frees two
    # slots at 20 s, the other one at 24 s; the fourth slot needed is one more hold after the first
    assert [holds.wait_s(k, now=16.0) for k in (1, 2, 3, 4)] == [4.0, 4.0, 8.0, 14.0]
    holds.end(10, 16.0)  # held 6 s: the average moves to 0.8 * 10 + 0.2 * 6 = 9.2 s
    assert holds.wait_s(1, now=16.0) == pytest.approx(7.2)


def test_deadlines_grow_along_the_shed_order() -> None:
    adm, _ = admission(1)
    tiers = [POLICY.get(n) for n in POLICY.names()]
    assert [adm.timeout_s(t, tiers) for t in (FREE, PLUS, ENT)] == [5.0, 10.0, 15.0]
    adm2, _ = admission(1, queue_timeout_s=1.0, queue_timeouts={"enterprise": 60.0})
    assert [adm2.timeout_s(t, tiers) for t in (FREE, PLUS, ENT)] == [1.0, 2.0, 60.0]


async def test_a_full_queue_sheds_free_first_and_enterprise_last() -> None:
    adm, registry = admission(1, queue_size=2)
    held = await adm.acquire(ENT, POLICY)
    ent = asyncio.create_task(adm.acquire(ENT, POLICY))
    free = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    plus = asyncio.create_task(adm.acquire(PLUS, POLICY))  # queue full: the free waiter goes
    await settle()
    with pytest.raises(Overloaded):
        await free
    free2 = asyncio.create_task(adm.acquire(FREE, POLICY))  # full again: the newcomer itself goes
    with pytest.raises(Overloaded):
        await free2
    ent2 = asyncio.create_task(adm.acquire(ENT, POLICY))  # enterprise displaces plus
    with pytest.raises(Overloaded):
        await plus
    assert registry.get_sample_value("switchboard_admission_shed_total", {"tier": "free", "reason": "queue_full"}) == 2
    assert registry.get_sample_value("switchboard_admission_shed_total", {"tier": "plus", "reason": "queue_full"}) == 1
    held.release()
    (await ent).release()
    (await ent2).release()
    assert adm.inflight == 0 and adm.waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_grant_frees_its_slot() -> None:
    adm, registry = admission(1)
    held = await adm.acquire(PLUS, POLICY)
    waiter = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    waiter.cancel()
    await settle()
    assert adm.waiting == 0 and registry.get_sample_value("switchboard_admission_queue_depth", {"tier": "free"}) == 0
    late = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    held.release()  # the slot goes to `late`, which is cancelled before it runs again
    late.cancel()
    await settle()
    assert adm.inflight == 0


async def test_a_release_right_after_a_waiter_is_cancelled_skips_it_and_serves_the_next() -> None:
    """QA (the real model, 22 streams then every client gone): a waiter's future is cancelled at once by
    `task.cancel()`, but the waiter leaves the queue only when its task runs again. A release in between
    admitted it anyway: `set_result` on the cancelled future raised InvalidStateError out of the *releasing*
    request's close ("unhandled error" in the gateway log, that request's response broken) and left the
    waiters behind it queued though a slot was free. Now the gone waiter is skipped and the next one gets
    the slot."""
    adm, registry = admission(1)
    held = await adm.acquire(PLUS, POLICY)
    gone = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    after = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    gone.cancel()  # its future is cancelled now; its task has not run yet
    held.release()  # raised InvalidStateError before the fix
    ticket = await asyncio.wait_for(after, 5)
    await settle()
    assert gone.cancelled() and adm.inflight == 1 and adm.waiting == 0
    assert registry.get_sample_value("switchboard_admission_queue_depth", {"tier": "free"}) == 0
    ticket.release()
    assert adm.inflight == 0


async def test_a_full_queue_never_sheds_a_waiter_already_cancelled_onto_the_newcomer() -> None:
    """The same window on the shed path: a newcomer that filled the queue picked the cancelled waiter as its
    victim, and `set_exception` on its future raised InvalidStateError out of the newcomer's own acquire."""
    adm, _ = admission(1, queue_size=1)
    held = await adm.acquire(PLUS, POLICY)
    gone = asyncio.create_task(adm.acquire(FREE, POLICY))
    await settle()
    newcomer = asyncio.create_task(adm.acquire(PLUS, POLICY))  # runs before `gone` sees its cancel
    gone.cancel()
    await settle()
    assert gone.cancelled() and not newcomer.done() and adm.waiting == 1
    held.release()
    (await asyncio.wait_for(newcomer, 5)).release()
    assert adm.inflight == 0 and adm.waiting == 0


async def test_a_ticket_dropped_unreleased_frees_its_slot_when_collected() -> None:
    adm, _ = admission(1)
    ticket: Ticket | None = await adm.acquire(FREE, POLICY)
    assert adm.inflight == 1
    del ticket
    gc.collect()
    await settle()
    assert adm.inflight == 0


async def test_unknown_capacity_admits_at_once() -> None:
    adm, registry = admission(None)
    tickets = [await adm.acquire(FREE, POLICY) for _ in range(100)]
    assert adm.inflight == 100 and registry.get_sample_value("switchboard_admission_capacity") == -1
    for t in tickets:
        t.release()


def test_capacity_comes_from_the_shards_batch_slots() -> None:
    config = AdmissionConfig()
    assert shard_capacity(["16", "8"], config) == 24
    assert shard_capacity([None], config) == 16  # a shard that does not say
    assert shard_capacity([], config) is None
    assert shard_capacity(["16", "16"], AdmissionConfig(inflight_per_slot=0.5)) == 16
    assert shard_capacity(["16"], AdmissionConfig(max_inflight=3)) == 3
    with pytest.raises(ValueError):
        AdmissionConfig(reserve=1.0)


# -- fair share between the tenants of a tier (VTC) --------------------------------------------------


async def test_a_flooding_tenant_does_not_starve_a_light_one_of_its_tier() -> None:
    """One slot; the flood queues 20 requests first, then a light tenant sends 2: the light one is
    served right after the request in flight, although it came last, and tier order stays above."""
    adm, registry = admission(1, reserve=0.0)
    held = await adm.acquire(FREE, POLICY, tenant="flood", tokens=100)
    order: list[str] = []

    async def one(name: str, tenant: str, tier=FREE) -> None:  # type: ignore[no-untyped-def]
        ticket = await adm.acquire(tier, POLICY, tenant=tenant, tokens=100)
        order.append(name)
        await asyncio.sleep(0)
        ticket.release(120)

    tasks = [asyncio.create_task(one(f"flood-{i}", "flood")) for i in range(20)]
    await settle()
    tasks += [asyncio.create_task(one(f"light-{i}", "light")) for i in range(2)]
    await settle()
    tasks.append(asyncio.create_task(one("enterprise", "big", ENT)))
    await settle()
    held.release(120)
    await asyncio.gather(*tasks)
    assert order[:3] == ["enterprise", "light-0", "flood-0"], order
    assert order.index("light-1") <= 4, order  # alternates with the flood, never behind all of it
    assert [o for o in order if o.startswith("flood")] == [f"flood-{i}" for i in range(20)]  # FIFO per tenant
    # service is counted in real tokens (120 each) and exported per tenant
    assert adm.fair_share.counter("free", "light") == pytest.approx(adm.fair_share.counter("free", "flood"),
                                                                    abs=21 * 120)
    adm.fair_share._publish(force=True)
    assert registry.get_sample_value("switchboard_admission_tenant_service_tokens",
                                     {"tier": "free", "tenant": "flood"}) == 21 * 120
    assert registry.get_sample_value("switchboard_admission_tenant_service_tokens",
                                     {"tier": "free", "tenant": "light"}) == 2 * 120


async def test_a_returning_tenant_is_lifted_to_the_active_ones() -> None:
    """An idle tenant's low counter would let it take every slot until it caught up: it is lifted
    to the least-served active tenant when it comes back."""
    adm, _ = admission(1, reserve=0.0)
    early = await adm.acquire(FREE, POLICY, tenant="early", tokens=10)
    early.release(10)
    for _ in range(5):
        t = await adm.acquire(FREE, POLICY, tenant="busy", tokens=1000)
        t.release(1000)
    held = await adm.acquire(FREE, POLICY, tenant="busy", tokens=1000)  # busy is active from here
    waiter = asyncio.create_task(adm.acquire(FREE, POLICY, tenant="early", tokens=10))
    await settle()
    assert adm.fair_share.counter("free", "early") >= 5000  # lifted, not 10
    held.release(1000)
    (await waiter).release(10)


async def test_queue_full_sheds_the_most_served_tenant_first() -> None:
    adm, registry = admission(1, reserve=0.0, queue_size=3)
    held = await adm.acquire(FREE, POLICY, tenant="flood", tokens=500)

    async def one(tenant: str, tokens: int) -> str:
        ticket = await adm.acquire(FREE, POLICY, tenant=tenant, tokens=tokens)
        ticket.release(tokens)
        return tenant

    flood = [asyncio.create_task(one("flood", 500)) for _ in range(3)]
    await settle()
    light = asyncio.create_task(one("light", 10))
    await settle()
    assert not light.done()  # the newcomer stays: the flood, with 1,500 tokens waiting, loses its newest
    shed = [t for t in flood if t.done()]
    assert len(shed) == 1 and isinstance(shed[0].exception(), Overloaded)
    assert registry.get_sample_value("switchboard_admission_shed_total", {"tier": "free", "reason": "queue_full"}) == 1
    held.release(500)
    assert await light == "light"
    assert [await t for t in flood if t is not shed[0]] == ["flood", "flood"]


def test_the_service_metric_is_bounded_to_the_top_n_and_other() -> None:
    from data_plane.gateway.fair_share import FairShare

    registry = CollectorRegistry()
    metrics = AdmissionMetrics(registry)
    share = FairShare(metrics.tenant_service, top_n=3, publish_interval_s=0.0)
    for i in range(10):
        share.arrive("free", f"t{i}", 2)
        share.charge("free", f"t{i}", 100 * (i + 1))
    tenants = {s.labels["tenant"]: s.value for m in registry.collect() for s in m.samples
               if m.name == "switchboard_admission_tenant_service_tokens"}
    assert tenants == {"t9": 1000, "t8": 900, "t7": 800, "other": sum(100 * (i + 1) for i in range(7))}


def test_a_charge_the_publish_throttle_held_back_shows_on_the_next_scrape() -> None:
    """The gauge is refreshed at most once per interval while charges come in: the last charges of a
    burst (a tenant's one request right after another's) showed on no scrape until the next charge,
    however long that took (CI read a tenant's 0 seconds after its request). flush(), which the
    gateway's /metrics calls, publishes them."""
    from data_plane.gateway.fair_share import FairShare

    registry = CollectorRegistry()
    now = [0.0]
    share = FairShare(AdmissionMetrics(registry).tenant_service, publish_interval_s=60.0, clock=lambda: now[0])

    def served(tenant: str) -> float | None:
        return registry.get_sample_value("switchboard_admission_tenant_service_tokens",
                                         {"tier": "plus", "tenant": tenant})

    share.arrive("plus", "acme", 2)
    share.charge("plus", "acme", 14)
    share.arrive("plus", "bigco", 2)
    now[0] = 0.5
    share.charge("plus", "bigco", 30)
    assert served("acme") == 14 and served("bigco") is None  # throttled
    share.flush()
    assert served("bigco") == 30
    share.flush()  # nothing new: no work, same values
    assert served("acme") == 14 and served("bigco") == 30


async def test_every_tiers_queue_depth_is_published_at_zero_from_the_first_request() -> None:
    """The dashboard's "Admission queue depth by tier" read "No data" until a request had queued."""
    adm, registry = admission(4)
    assert registry.get_sample_value("switchboard_admission_queue_depth", {"tier": "free"}) is None
    ticket = await adm.acquire(PLUS, POLICY)  # admitted at once: nothing ever queued
    for name in POLICY.names():
        assert registry.get_sample_value("switchboard_admission_queue_depth", {"tier": name}) == 0
    ticket.release()
