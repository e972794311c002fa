"""SessionStore against real cache-node processes: placement, failover, read-repair, ownership."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from data_plane.cache.client import SessionStore
from data_plane.cache.model import Transcript, VersionConflict
from data_plane.common.errors import InvalidRequest, NotFound, Overloaded
from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.hop_client import HopPool
from tests.support.cluster import cache_node, start_cache_nodes
from tests.support.procs import Service, free_port
from tests.support.redis import RedisServer

MESSAGES = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]


def members(nodes: list[Service]) -> list[Member]:
    return [Member(id=f"cache-{n.port}", service="cache", url=n.url) for n in nodes]


def dead_member(name: str = "cache-dead") -> Member:
    return Member(id=name, service="cache", url=f"http://127.0.0.1:{free_port()}")


def holders(nodes: list[Service], session_id: str) -> set[str]:
    with httpx.Client(timeout=2.0) as c:
        return {
            f"cache-{n.port}"
            for n in nodes
            if n.proc.poll() is None and c.get(f"{n.url}/v1/sessions/{session_id}").status_code == 200
        }


def ops(registry: CollectorRegistry, op: str, result: str) -> float:
    return (
        registry.get_sample_value("switchboard_session_store_ops_total", {"op": op, "result": result}) or 0.0
    )


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    nodes = start_cache_nodes(3, log_dir=tmp_path_factory.mktemp("trio"))
    yield nodes
    for n in nodes:
        n.stop()


async def test_save_writes_the_preference_list_and_load_reads_it_back(trio: list[Service]) -> None:
    registry = CollectorRegistry()
    async with HopPool() as http:
        store = SessionStore(StaticMembership(members(trio)), http, registry=registry)
        assert await store.save("conv-1", "key-a", MESSAGES, version=1, replicas=2, ttl_s=60) == 2
        expected = {m.id for m in store.replicas_for("conv-1", 2)}
        assert holders(trio, "conv-1") == expected and len(expected) == 2
        got = await store.load("conv-1", "key-a", replicas=2)
        assert isinstance(got, Transcript)
        assert (got.owner, list(got.messages), got.version) == ("key-a", MESSAGES, 1)
        assert await store.load("conv-unknown", "key-a", replicas=2) is None
        assert await store.save("conv-all", "key-a", MESSAGES, version=1, replicas=9) == 3
    assert (ops(registry, "save", "ok"), ops(registry, "load", "hit"), ops(registry, "load", "miss")) == (
        2,
        1,
        1,
    )
    assert registry.get_sample_value("switchboard_session_store_seconds_count", {"op": "load"}) == 2


async def test_owner_mismatch_is_not_found_and_repairs_nothing(trio: list[Service]) -> None:
    async with HopPool() as http:
        full = StaticMembership(members(trio))
        store = SessionStore(full, http)
        await store.save("conv-owned", "key-a", MESSAGES, version=1, replicas=1)
        with pytest.raises(NotFound) as caught:
            await store.load("conv-owned", "key-b", replicas=3)
        assert caught.value.code == "session_not_found" and caught.value.status == 404
        await store.drain()
        assert len(holders(trio, "conv-owned")) == 1


async def test_a_replica_left_behind_is_brought_up_to_the_version_read(trio: list[Service]) -> None:
    registry = CollectorRegistry()
    async with HopPool() as pool, httpx.AsyncClient() as http:  # the test talks to nodes on its own
        store = SessionStore(StaticMembership(members(trio)), pool, registry=registry)
        await store.save("conv-lag", "key-a", MESSAGES[:1], version=1, replicas=2)
        primary, lagging = store.replicas_for("conv-lag", 2)
        body = {"owner": "key-a", "messages": MESSAGES, "version": 2}
        assert (await http.put(f"{primary.url}/v1/sessions/conv-lag", json=body)).status_code == 200
        got = await store.load("conv-lag", "key-a", replicas=2)
        assert got is not None and got.version == 2
        await store.drain()
        behind = (await http.get(f"{lagging.url}/v1/sessions/conv-lag")).json()
        assert (behind["version"], behind["messages"]) == (2, MESSAGES)
    assert registry.get_sample_value("switchboard_session_replica_repairs_total") == 1


async def test_stale_write_raises_version_conflict(trio: list[Service]) -> None:
    async with HopPool() as http:
        store = SessionStore(StaticMembership(members(trio)), http)
        assert await store.save("conv-v", "key-a", MESSAGES, version=5, replicas=2) == 2
        with pytest.raises(VersionConflict) as caught:
            await store.save("conv-v", "key-a", MESSAGES[:1], version=4, replicas=2)
        assert (caught.value.status, caught.value.stored_version) == (409, 5)
        loaded = await store.load("conv-v", "key-a", replicas=2)
        assert loaded is not None and loaded.version == 5


async def test_partial_acks_are_counted_and_zero_acks_are_overloaded(trio: list[Service]) -> None:
    async with HopPool() as http:
        half = SessionStore(StaticMembership([*members(trio[:1]), dead_member()]), http, timeout_s=0.5)
        assert await half.save("conv-half", "key-a", MESSAGES, version=1, replicas=2) == 1
        assert (await half.load("conv-half", "key-a", replicas=2)) is not None

        dead = SessionStore(StaticMembership([dead_member("d1"), dead_member("d2")]), http, timeout_s=0.5)
        for call in (
            dead.save("conv-x", "key-a", MESSAGES, version=1, replicas=2),
            dead.load("conv-x", "key-a", replicas=2),
        ):
            with pytest.raises(Overloaded) as caught:
                await call
            assert (caught.value.code, caught.value.status, caught.value.retry_after) == (
                "cache_unavailable",
                503,
                1,
            )


async def test_no_cache_members_is_overloaded_and_bad_ids_are_invalid() -> None:
    async with HopPool() as http:
        store = SessionStore(StaticMembership([]), http)
        with pytest.raises(Overloaded) as caught:
            await store.load("conv-1", "key-a", replicas=2)
        assert caught.value.code == "cache_unavailable" and caught.value.retry_after == 1
        with pytest.raises(InvalidRequest):
            await store.save("no spaces", "key-a", MESSAGES, version=1, replicas=2)


async def test_survives_kill_9_and_read_repairs_when_membership_changes(tmp_path: Path) -> None:
    nodes = start_cache_nodes(3, log_dir=tmp_path)
    by_id = {f"cache-{n.port}": n for n in nodes}
    registry = CollectorRegistry()
    try:
        async with HopPool() as http:
            store = SessionStore(StaticMembership(members(nodes)), http, registry=registry, timeout_s=0.5)
            assert await store.save("conv-dur", "key-a", MESSAGES, version=3, replicas=2, ttl_s=120) == 2
            first, second = (m.id for m in store.replicas_for("conv-dur", 2))
            (spare,) = set(by_id) - {first, second}

            by_id[first].kill()  # the primary replica dies without a word
            got = await store.load("conv-dur", "key-a", replicas=2)
            assert got is not None and got.version == 3 and list(got.messages) == MESSAGES
            await store.drain()
            assert registry.get_sample_value("switchboard_session_replica_repairs_total") == 0

            # Membership notices: the spare now sits on the preference list, answers 404, and
            # gets the record written back from the surviving replica.
            survivors = [n for n in nodes if f"cache-{n.port}" != first]
            registry = CollectorRegistry()
            store = SessionStore(StaticMembership(members(survivors)), http, registry=registry)
            assert {m.id for m in store.replicas_for("conv-dur", 2)} == {second, spare}
            assert (await store.load("conv-dur", "key-a", replicas=2)) is not None
            await store.drain()
            assert registry.get_sample_value("switchboard_session_replica_repairs_total") == 1
            assert ops(registry, "repair", "ok") == 1
            assert holders(nodes, "conv-dur") == {second, spare}

            # The repaired copy kept version, timestamps and TTL: it alone now carries the session.
            by_id[second].kill()
            again = await store.load("conv-dur", "key-a", replicas=2)
            assert again is not None and (again.version, again.updated_at) == (got.version, got.updated_at)
            assert again.expires_at is not None and got.expires_at is not None
            assert abs(again.expires_at - got.expires_at) < 1.0
            await store.aclose()
    finally:
        for n in nodes:
            n.stop()


async def test_steady_reads_ask_one_replica_and_a_missed_write_is_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save writes all current replicas, so a read that hits the first one leaves the others
    alone, unless the placement changed since the write or a save here missed a replica."""
    from data_plane.cache import client as cache_client

    monkeypatch.setattr(cache_client, "AUDIT_SHARE", 0.0)
    monkeypatch.setattr(cache_client, "CLOCK_SLACK_S", -0.2)  # clocks agree here: no slack needed
    nodes = start_cache_nodes(3, log_dir=tmp_path)
    try:
        async with HopPool() as http:
            store = SessionStore(StaticMembership(members(nodes)), http)
            asked: list[str] = []
            fetch = store._fetch

            async def counted(member: Member, session_id: str) -> tuple[str, Transcript | None]:
                asked.append(member.id)
                return await fetch(member, session_id)

            store._fetch = counted  # type: ignore[method-assign]
            store.replicas_for("conv-steady", 2)  # the placement takes effect before the write
            await asyncio.sleep(0.3)
            assert await store.save("conv-steady", "key-a", MESSAGES, version=1, replicas=2) == 2
            for _ in range(3):
                asked.clear()
                assert await store.load("conv-steady", "key-a", replicas=2) is not None
                assert len(asked) == 1 and not store._repairs, "a steady read asked the other replica too"

            _, second = store.replicas_for("conv-steady", 2)
            next(n for n in nodes if f"cache-{n.port}" == second.id).kill()
            assert await store.save("conv-steady", "key-a", MESSAGES, version=2, replicas=2) == 1
            asked.clear()
            assert await store.load("conv-steady", "key-a", replicas=2) is not None
            assert second.id in asked, "the replica that missed the write was not checked"
            await store.drain()
    finally:
        for n in nodes:
            n.stop()


class ChangingView:
    """A membership view whose members the test changes (a zone leaving and coming back)."""

    def __init__(self, members: list[Member]) -> None:
        self.now = members

    def members(self, service: str) -> list[Member]:
        return [m for m in self.now if m.service == service]


async def test_a_zone_that_comes_back_gets_recent_sessions_in_the_background(trio: list[Service]) -> None:
    """Read repair alone would leave paid sessions saved during an outage with one copy until read."""
    registry = CollectorRegistry()
    zoned = [Member(id=f"cache-{n.port}", service="cache", url=n.url, meta={"zone": z}) for n, z in zip(trio, "ab")]
    view = ChangingView(zoned[:1])  # zone b is away
    async with HopPool() as http:
        store = SessionStore(view, http, registry=registry, zone="a")
        for i in range(5):
            assert await store.save(f"away-{i}", "key-a", MESSAGES, version=1, replicas=2, ttl_s=60) == 1
        assert holders(trio[:2], "away-0") == {zoned[0].id}
        view.now = zoned  # zone b is back
        assert {m.zone for m in store.replicas_for("any-request", 2)} == {"a", "b"}  # the next request notices
        await store.drain()
        for i in range(5):
            assert holders(trio[:2], f"away-{i}") == {zoned[0].id, zoned[1].id}, i
        assert registry.get_sample_value("switchboard_session_replica_repairs_total") == 5
        got = await store.load("away-3", "key-a", replicas=2)
        assert got is not None and list(got.messages) == MESSAGES


def stored_version(node: Service, session_id: str) -> int | None:
    r = httpx.get(f"{node.url}/v1/sessions/{session_id}", timeout=2.0)
    return None if r.status_code == 404 else int(r.json()["version"])


async def test_a_replica_down_during_a_delete_never_brings_the_record_back(trio: list[Service]) -> None:
    """Deleted is gone from every replica: the node that missed the delete (away) holds an old copy;
    the tombstone left on the others wins every read that compares them, is written over the old
    copy by read-repair and by the deleting gateway's repair of a node that joins, and refuses any
    write of the old record."""
    from data_plane.cache.model import TOMBSTONE_VERSION

    pair, registry = members(trio[:2]), CollectorRegistry()
    away, present = pair[0], pair[1]
    view = ChangingView(pair)
    async with HopPool() as http:
        store = SessionStore(view, http, registry=registry)
        # ids the node that will be away reads first, as a fresh gateway orders them
        sid, sid2 = [s for s in (f"gone-{i}" for i in range(200)) if store.replicas_for(s, 2)[0].id == away.id][:2]
        for s in (sid, sid2):
            assert await store.save(s, "key-a", MESSAGES, version=1, replicas=2, ttl_s=60) == 2
        view.now = [present]  # `away` is cut off while both are deleted
        for s in (sid, sid2):
            assert await store.delete(s, "key-a", replicas=2) == 1
            assert stored_version(trio[0], s) == 1 and stored_version(trio[1], s) == TOMBSTONE_VERSION
            assert await store.load(s, "key-a", replicas=2) is None
        with pytest.raises(NotFound):  # deleting again: it is gone
            await store.delete(sid, "key-a", replicas=2)

        # Another gateway (or this one restarted) sees both nodes; the one that was away answers first.
        other = SessionStore(StaticMembership(pair), http, registry=CollectorRegistry())
        assert other.replicas_for(sid, 2)[0].id == away.id
        assert await other.load(sid, "key-a", replicas=2) is None
        await other.drain()
        assert stored_version(trio[0], sid) == TOMBSTONE_VERSION  # read-repair wrote the tombstone over it
        with pytest.raises(VersionConflict):  # a late write of the old record lands nowhere
            await other.save(sid, "key-a", MESSAGES, version=2, replicas=2)

        # The deleting gateway sees `away` come back: its background repair gives it the tombstone.
        view.now = pair
        store.replicas_for("any-request", 2)
        await store.drain()
        assert stored_version(trio[0], sid2) == TOMBSTONE_VERSION
        assert await store.load(sid2, "key-a", replicas=2) is None
    assert ops(registry, "load", "deleted") >= 2


async def test_a_replica_down_during_a_delete_is_compared_on_the_next_read(
        trio: list[Service], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No placement change at all (static membership; a Redis-backed node killed for the delete and
    restarted on its port with its old copy): the delete that missed a replica makes the next read
    compare them, and the tombstone wins."""
    from data_plane.cache import client as cache_client
    from data_plane.cache import client_circuits
    from data_plane.cache.model import TOMBSTONE_VERSION

    monkeypatch.setattr(cache_client, "AUDIT_SHARE", 0.0)
    monkeypatch.setattr(cache_client, "CLOCK_SLACK_S", -0.2)  # only the missed delete makes a read compare
    # the node's breaker would skip it for a hold after the failed delete (client_circuits.py): not what this is about
    monkeypatch.setattr(client_circuits, "EJECT_AFTER", 1_000)
    args = ("--redis", redis_server.url, "--redis-prefix", "sb-test-tombstone:")
    node = cache_node(*args).start()
    try:
        pair = members([node, trio[1]])
        async with HopPool() as http:
            store = SessionStore(StaticMembership(pair), http, timeout_s=0.5)
            sid = next(s for s in (f"down-{i}" for i in range(200)) if store.replicas_for(s, 2)[0].id == pair[0].id)
            await asyncio.sleep(0.3)  # the placement is older than the write
            assert await store.save(sid, "key-a", MESSAGES, version=1, replicas=2, ttl_s=60) == 2
            node.kill()
            assert await store.delete(sid, "key-a", replicas=2) == 1
            node = cache_node(*args, port=node.port).start()  # back, its Redis still holding the old copy
            assert stored_version(node, sid) == 1
            assert await store.load(sid, "key-a", replicas=2) is None
            await store.drain()
            assert stored_version(node, sid) == TOMBSTONE_VERSION
    finally:
        node.stop()


class _Changing(StaticMembership):
    """Membership whose members a test sets (a node leaving and coming back)."""

    def set(self, members: list[Member]) -> None:
        self._members = tuple(members)


async def test_a_miss_while_its_node_is_away_is_unavailable_not_a_verdict(
        trio: list[Service], monkeypatch: pytest.MonkeyPatch) -> None:
    """A free session lives on one node. Killed -9 and restarted, that node is back with its snapshot
    within seconds, but meanwhile its sessions placed on the others answered 404, "start a new
    conversation". A miss on a record the client was handed (`expected`) is now a 503 with Retry-After
    while a node that held it left less than DEPARTED_GRACE_S ago; other misses stay 404s at once."""
    registry = CollectorRegistry()
    everyone = members(trio)
    membership = _Changing(everyone)
    async with HopPool() as http:
        store = SessionStore(membership, http, registry=registry, timeout_s=0.5)
        await store.save("sess-away", "key-a", MESSAGES, version=1, replicas=1, ttl_s=60)
        (home,) = store.replicas_for("sess-away", 1)
        elsewhere = next(f"sess-{i}" for i in range(100) if store.replicas_for(f"sess-{i}", 1)[0].id != home.id)
        membership.set([m for m in everyone if m.id != home.id])  # it left membership
        with pytest.raises(Overloaded) as err:
            await store.load("sess-away", "key-a", replicas=1, expected=True)
        assert err.value.code == "cache_unavailable" and err.value.retry_after == 2
        assert await store.load("sess-away", "key-a", replicas=1) is None  # a plain lookup: a miss
        assert await store.load(elsewhere, "key-a", replicas=1, expected=True) is None  # never on that node
        assert ops(registry, "load", "away") == 1
        membership.set(everyone)  # back, with its records
        got = await store.load("sess-away", "key-a", replicas=1, expected=True)
        assert got is not None and list(got.messages) == MESSAGES
        membership.set([m for m in everyone if m.id != home.id])  # gone for good: a verdict after the grace
        monkeypatch.setattr("data_plane.cache.client_values.DEPARTED_GRACE_S", 0.0)
        assert await store.load("sess-away", "key-a", replicas=1, expected=True) is None
        await store.aclose()


def test_the_ring_as_it_was_is_built_once_per_departure_not_per_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every continued session a departed node held misses for DEPARTED_GRACE_S, and each miss built the
    ring "as it was" again (128 vnodes a node: 1-3 ms of the gateway's event loop per request, at the
    moment a node's sessions all come back at once). It is built once per (placement, departures)."""
    from data_plane.cache import client_values
    from data_plane.membership.hashring import HashRing

    nodes = [Member(id=f"cache-{i}", service="cache", url=f"http://127.0.0.1:{9000 + i}") for i in range(4)]
    before = client_values.Placement(tuple((m.id, m.url, m.zone) for m in nodes),
                                     HashRing(m.id for m in nodes), {m.id: m for m in nodes},
                                     zone_of={m.id: m.zone for m in nodes})
    after = client_values.Placement(tuple((m.id, m.url, m.zone) for m in nodes[1:]),
                                    HashRing(m.id for m in nodes[1:]), {m.id: m for m in nodes[1:]},
                                    zone_of={m.id: m.zone for m in nodes[1:]})
    departures = client_values.Departures()
    departures.changed(before, set(after.by_id))
    built: list[int] = []
    real = client_values.HashRing

    def counting(*args: object, **kwargs: object) -> HashRing:
        built.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client_values, "HashRing", counting)
    verdicts = [departures.may_hold(f"sess-{i}", 1, after, 128, "local") for i in range(200)]
    held = [f"sess-{i}" for i in range(200)
            if client_values.replicas_across_zones(before.ring.walk(f"sess-{i}"), 1, before.zone_of,
                                                   local="local") == ["cache-0"]]
    assert [f"sess-{i}" for i, v in enumerate(verdicts) if v] == held and held  # the same answers
    assert len(built) == 1, f"the ring was built {len(built)} times for 200 misses"


def skipped(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("switchboard_session_store_nodes_skipped")


async def test_a_cache_node_that_rejoins_membership_is_used_at_once_not_after_its_breaker_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache node killed -9 fails a gateway's calls, so its breaker opens (client_circuits.py) with a hold
    that doubles up to 10 s while the node stays down. Restarted, it rejoins membership, but the gateway
    skipped it for what was left of the hold: a free session placed on it answered 503 "no cache replica
    answered" (here a save: no replica acknowledged it) and the placement repair of its rejoining was skipped
    too. Membership's word that it is back now forgets the breaker. A node that leaves membership after
    failing is forgotten as well: nothing would ever probe it, and the skipped-nodes gauge (and the
    SwitchboardCacheNodeUnreachableFromGateway alert on it) stayed up for good."""
    from data_plane.cache import client_circuits

    monkeypatch.setattr(client_circuits, "HOLD_S", 60.0)  # a long hold: what the node's downtime grew it to
    monkeypatch.setattr(client_circuits, "MAX_HOLD_S", 60.0)
    nodes = start_cache_nodes(2, log_dir=tmp_path)
    everyone = members(nodes)
    membership = _Changing(everyone)
    registry = CollectorRegistry()
    try:
        async with HopPool() as http:
            store = SessionStore(membership, http, registry=registry, timeout_s=0.5)
            home, other = nodes
            sid = next(f"free-{i}" for i in range(200) if store.replicas_for(f"free-{i}", 1)[0].url == home.url)
            home.kill()
            for _ in range(2):  # its calls fail: the breaker opens
                with pytest.raises(Overloaded):
                    await store.save(sid, "key-a", MESSAGES, version=1, replicas=1, ttl_s=60)
            assert skipped(registry) == 1
            membership.set([m for m in everyone if m.url != home.url])  # its TTL ran out: it left
            assert store.replicas_for(sid, 1)[0].url == other.url
            restarted = cache_node(log_dir=tmp_path, port=home.port).start()
            nodes.append(restarted)
            membership.set(everyone)  # registered again
            assert await store.save(sid, "key-a", MESSAGES, version=1, replicas=1, ttl_s=60) == 1
            got = await store.load(sid, "key-a", replicas=1, expected=True)
            assert got is not None and list(got.messages) == MESSAGES
            assert skipped(registry) == 0

            gone = dead_member("cache-gone")  # fails, then leaves membership for good
            membership.set([*everyone, gone])
            sid = next(f"gone-{i}" for i in range(200) if store.replicas_for(f"gone-{i}", 1)[0].id == gone.id)
            for _ in range(2):
                with pytest.raises(Overloaded):
                    await store.save(sid, "key-a", MESSAGES, version=1, replicas=1, ttl_s=60)
            assert skipped(registry) == 1
            membership.set(everyone)
            store.on_membership_change()
            assert skipped(registry) == 0
            await store.aclose()
    finally:
        for n in nodes:
            n.stop()


def test_a_node_breaker_stays_open_when_a_call_sent_before_it_opened_succeeds() -> None:
    """A call to a cache node sent before its breaker opened, succeeding after, closed the breaker: a flaky node
    was back in use at once, as the router's ejections were (review3). Only the probe after the hold closes it."""
    from data_plane.cache.client_circuits import NodeCircuits

    now = [0.0]
    changes: list[tuple[int, bool]] = []
    circuits = NodeCircuits(lambda count, opened: changes.append((count, opened)), eject_after=2, hold_s=2.0,
                            clock=lambda: now[0])
    circuits.failed("n1")
    circuits.failed("n1")
    assert not circuits.allow("n1") and changes == [(1, True)]
    circuits.succeeded("n1")  # the late success of a call sent before the breaker opened
    assert not circuits.allow("n1") and circuits.open_count() == 1 and changes == [(1, True)]
    now[0] = 2.5
    assert circuits.allow("n1")  # the one probe after the hold...
    circuits.succeeded("n1")  # ...answers: back in use
    assert circuits.allow("n1") and circuits.open_count() == 0 and changes[-1] == (0, False)


async def test_what_a_one_copy_record_got_while_its_node_was_away_is_read_when_it_comes_back(
    trio: list[Service],
) -> None:
    """QA: a free conversation's turn written while its only node was stopped went to the next node on the ring;
    when the node came back its old copy was read, and the turn was gone (no error, nothing logged). A record
    created meanwhile read as missing. Both are read from where they were written, then repaired onto the node."""
    everyone = members(trio)
    view = ChangingView(everyone)
    async with HopPool() as http:
        store = SessionStore(view, http, registry=CollectorRegistry())
        home = store.replicas_for("turned", 1)[0]
        assert await store.save("turned", "key-a", MESSAGES[:1], version=1, replicas=1, ttl_s=60) == 1
        new = next(f"new-{i}" for i in range(100) if store.replicas_for(f"new-{i}", 1)[0] == home)
        view.now = [m for m in everyone if m != home]  # its node stops: the next one takes its records
        assert await store.save("turned", "key-a", MESSAGES, version=2, replicas=1, ttl_s=60) == 1
        assert await store.save(new, "key-a", MESSAGES, version=1, replicas=1, ttl_s=60) == 1
        view.now = everyone  # it comes back with its old copy of "turned" and none of the new one
        got = await store.load("turned", "key-a", replicas=1)
        assert got is not None and got.version == 2 and list(got.messages) == MESSAGES
        got = await store.load(new, "key-a", replicas=1)
        assert got is not None and list(got.messages) == MESSAGES
        await store.drain()
        assert stored_version(next(n for n in trio if f"cache-{n.port}" == home.id), "turned") == 2
        assert home.id in holders(trio, new)
