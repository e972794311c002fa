"""A record's copies across cache membership changes, against real cache-node processes: what a node that held a
record while its replica was away keeps once that replica is back (data_plane/cache/client.py's handoffs).

A chat user's conversation must never lose a turn nor go back in time. A free conversation has one copy: while
its node is away its turns go to the next node on the ring; when the node comes back the newest copy is read and
repaired onto it. The copy left behind was kept for its TTL (24 h): when the node went away again, that older copy
was read, the conversation went back to it, and a turn written on it then lost to the node's higher version when
it came back. It is now removed once the record is back on its replicas (only the version seen: a write that
landed there since is left alone), and counted in ``switchboard_session_moved_copies_total``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from data_plane.cache import client as cache_client
from data_plane.cache.client import SessionStore
from data_plane.common.errors import NotFound, Overloaded
from data_plane.membership.view import Member
from data_plane.routing.hop_client import HopPool
from tests.data_plane.test_cache_client import MESSAGES, ChangingView, members, stored_version
from tests.support.cluster import start_cache_nodes
from tests.support.procs import Service

TURNS = [{"role": "user", "content": f"turn {i}"} for i in range(8)]


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    nodes = start_cache_nodes(3, log_dir=tmp_path_factory.mktemp("handoff"))
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture
def settle_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """No membership view lags here: a moved copy is removed as soon as the record is back on its replicas."""
    monkeypatch.setattr(cache_client, "HANDOFF_SETTLE_S", 0.0)


def node_of(trio: list[Service], member: Member) -> Service:
    return next(n for n in trio if n.url == member.url)


def moved(registry: CollectorRegistry, result: str) -> float:
    return registry.get_sample_value("switchboard_session_moved_copies_total", {"result": result}) or 0.0


async def test_a_conversation_never_goes_back_to_the_copy_its_node_left_behind(
        trio: list[Service], settle_now: None) -> None:
    """Free tier, one copy; its node flaps twice. After the first return the turn written meanwhile is read back
    and repaired onto it, and the substitute's copy is removed; turns go on, on the home node. When it goes away
    again the conversation is unavailable (503, retry), never its older copy (it went back two turns, and the
    next turn, written on that copy, lost to the home node's higher version when it came back)."""
    everyone, registry = members(trio), CollectorRegistry()
    view = ChangingView(everyone)
    async with HopPool() as http:
        store = SessionStore(view, http, registry=registry)
        sid = "flap-twice"
        (home,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", TURNS[:1], version=1, replicas=1, ttl_s=60) == 1
        view.now = [m for m in everyone if m != home]  # its node stops
        (sub,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", TURNS[:2], version=2, replicas=1, ttl_s=60, only_newer=True) == 1
        view.now = everyone  # back, with version 1
        got = await store.load(sid, "key-a", replicas=1, expected=True)
        assert got is not None and got.version == 2
        await store.drain()
        assert (stored_version(node_of(trio, home), sid), stored_version(node_of(trio, sub), sid)) == (2, None)
        assert moved(registry, "removed") == 1  # (the joiner's background repair may have found it gone)
        assert (registry.get_sample_value("switchboard_session_replica_repairs_total") or 0) >= 1
        for v in (3, 4):  # the conversation goes on, on its node
            assert await store.save(sid, "key-a", TURNS[:v], version=v, replicas=1, ttl_s=60, only_newer=True) == 1

        view.now = [m for m in everyone if m != home]  # away again
        with pytest.raises(Overloaded) as err:
            await store.load(sid, "key-a", replicas=1, expected=True)
        assert err.value.code == "cache_unavailable"
        assert await store.load(sid, "key-a", replicas=1) is None  # a plain lookup: a miss, never version 2
        view.now = everyone
        got = await store.load(sid, "key-a", replicas=1, expected=True)
        assert got is not None and (got.version, list(got.messages)) == (4, TURNS[:4])
        await store.aclose()


async def test_a_paid_conversation_never_goes_back_to_a_copy_left_in_its_zone(
        trio: list[Service], settle_now: None) -> None:
    """Paid tier, two copies in two zones. Its zone-a node away, the turn went to the other zone-a node; once it is
    back, that copy is removed. Then zone a's node and zone b both away: the conversation is unavailable, not two
    turns back (the left copy was the only one a read could reach, so nothing outvoted it)."""
    zones = "aab"
    zoned = [Member(id=f"cache-{n.port}", service="cache", url=n.url, meta={"zone": z}) for n, z in zip(trio, zones)]
    view, registry = ChangingView(zoned), CollectorRegistry()
    async with HopPool() as http:
        store = SessionStore(view, http, registry=registry, zone="a")
        sid = next(s for s in (f"paid-{i}" for i in range(200)) if store.replicas_for(s, 2)[0] == zoned[0])
        assert await store.save(sid, "key-a", TURNS[:1], version=1, replicas=2, ttl_s=60) == 2
        view.now = zoned[1:]  # its zone-a node away: zone a's other node takes the turn
        assert [m.id for m in store.replicas_for(sid, 2)] == [zoned[1].id, zoned[2].id]
        assert await store.save(sid, "key-a", TURNS[:2], version=2, replicas=2, ttl_s=60, only_newer=True) == 2
        view.now = zoned
        got = await store.load(sid, "key-a", replicas=2, expected=True)
        assert got is not None and got.version == 2
        await store.drain()
        assert [stored_version(n, sid) for n in trio] == [2, None, 2]
        assert await store.save(sid, "key-a", TURNS[:3], version=3, replicas=2, ttl_s=60, only_newer=True) == 2

        view.now = [zoned[1]]  # its zone-a node away again, and zone b cut off
        with pytest.raises(Overloaded):
            await store.load(sid, "key-a", replicas=2, expected=True)
        view.now = zoned
        got = await store.load(sid, "key-a", replicas=2, expected=True)
        assert got is not None and got.version == 3
        assert moved(registry, "removed") == 1
        await store.aclose()


async def test_a_returning_node_s_background_repair_removes_the_copy_left_behind(
        trio: list[Service], settle_now: None) -> None:
    """The joiner's background repair (no read needed) brings the turn written meanwhile back and removes the
    substitute's copy, as a read does."""
    everyone, registry = members(trio), CollectorRegistry()
    view = ChangingView(everyone)
    async with HopPool() as http:
        store = SessionStore(view, http, registry=registry)
        sid = "joiner-repair"
        (home,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", TURNS[:1], version=1, replicas=1, ttl_s=60) == 1
        view.now = [m for m in everyone if m != home]
        (sub,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", TURNS[:2], version=2, replicas=1, ttl_s=60, only_newer=True) == 1
        view.now = everyone
        store.on_membership_change()
        await store.drain()
        assert (stored_version(node_of(trio, home), sid), stored_version(node_of(trio, sub), sid)) == (2, None)
        assert moved(registry, "removed") == 1
        await store.aclose()


async def test_a_write_that_lands_on_the_left_copy_meanwhile_is_never_removed(
        trio: list[Service], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers: another gateway whose membership view still has the node away writes its turn onto the
    substitute after this one read the copy there. The removal takes only the version it saw: the newer write
    stays (and wins the next read that compares them), counted as kept."""
    monkeypatch.setattr(cache_client, "HANDOFF_SETTLE_S", 1.5)  # this view's change is older than that when it runs
    everyone, registry = members(trio), CollectorRegistry()
    view = ChangingView(everyone)
    async with HopPool() as pool, httpx.AsyncClient(timeout=2.0) as http:
        store = SessionStore(view, pool, registry=registry)
        sid = "two-writers"
        (home,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", TURNS[:1], version=1, replicas=1, ttl_s=60) == 1
        view.now = [m for m in everyone if m != home]
        (sub,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", TURNS[:2], version=2, replicas=1, ttl_s=60, only_newer=True) == 1
        reader = SessionStore(view, pool, registry=(registry := CollectorRegistry()))  # a gateway that only reads it (no background repair)
        reader.replicas_for(sid, 1)
        view.now = everyone
        got = await reader.load(sid, "key-a", replicas=1, expected=True)
        assert got is not None and got.version == 2
        late = {"owner": "key-a", "messages": TURNS[:3], "version": 3, "only_newer": True}  # the lagging gateway
        assert (await http.put(f"{sub.url}/v1/sessions/{sid}", json=late)).status_code == 200
        await reader.drain()
        assert (stored_version(node_of(trio, home), sid), stored_version(node_of(trio, sub), sid)) == (2, 3)
        assert (moved(registry, "kept"), moved(registry, "removed")) == (1, 0)
        got = await reader.load(sid, "key-a", replicas=1, expected=True)  # the copies are compared again
        assert got is not None and got.version == 3
        await reader.drain()
        assert (stored_version(node_of(trio, home), sid), stored_version(node_of(trio, sub), sid)) == (3, None)
        await reader.aclose()


async def test_a_delete_while_its_node_is_away_is_503_and_never_a_404_the_conversation_outlives(
        trio: list[Service]) -> None:
    """A free conversation's node away (within the grace after it left): deleting it answered 404 "not found",
    and when the node came back the conversation was there again. It is a 503 to retry; once the node is back
    the delete goes through, and nothing brings the conversation back."""
    everyone = members(trio)
    view = ChangingView(everyone)
    async with HopPool() as http:
        store = SessionStore(view, http, registry=CollectorRegistry())
        sid = "delete-away"
        (home,) = store.replicas_for(sid, 1)
        assert await store.save(sid, "key-a", MESSAGES, version=1, replicas=1, ttl_s=60) == 1
        view.now = [m for m in everyone if m != home]
        with pytest.raises(Overloaded) as err:
            await store.delete(sid, "key-a", replicas=1)
        assert (err.value.status, err.value.code) == (503, "cache_unavailable")
        view.now = everyone
        assert await store.delete(sid, "key-a", replicas=1) == 1
        assert await store.load(sid, "key-a", replicas=1) is None
        with pytest.raises(NotFound):
            await store.delete(sid, "key-a", replicas=1)
        await store.aclose()


async def test_a_moved_copy_on_a_node_of_before_conditional_deletes_is_kept() -> None:
    """Rolling upgrade: a cache node of before conditional deletes ignored ``?if_version=N`` and removed the record
    whatever version it held, a turn written there since included, and said "deleted". The condition is in the
    path now, which such a node refuses (400: an invalid session id), so the copy is kept ("error")."""
    import asyncio
    import json
    import re

    held = {"old-node-copy": 3}

    async def old_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, target, _ = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split(" ", 2)
        session_id = target.split("?", 1)[0].removeprefix("/v1/sessions/")  # its route: {session_id:path}
        if method == "DELETE" and re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", session_id):
            status, body = "200 OK", {"session_id": session_id, "deleted": held.pop(session_id, None) is not None}
        else:
            status, body = "400 Bad Request", {"error": {"message": "invalid session id", "code": "invalid_value"}}
        raw = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n"
                     f"\r\n".encode() + raw)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(old_node, "127.0.0.1", 0)
    node = Member("cache-old", "cache", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        async with HopPool() as http:
            store = SessionStore(ChangingView([node]), http, registry=CollectorRegistry())
            assert await store._remove_copy(node, "old-node-copy", version=2) == "error"
    finally:
        server.close()
    assert held == {"old-node-copy": 3}, "the version written there since was removed"
