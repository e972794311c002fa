"""The cache node, as real processes on loopback ports: in-memory and Redis backends.

The nodes come from tests.support.cluster (cache_node, start_cache_nodes); Redis from the
`redis_server` fixture (tests/conftest.py).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from control_plane.supervisor import LIVENESS_PROBE_TIMEOUT_S
from data_plane.cache.model import Transcript
from data_plane.cache.node import parse_settings
from data_plane.cache.snapshot import Snapshot
from data_plane.cache.storage import MemoryStorage, encode_record
from tests.support.chat import assert_openai_error
from tests.support.clock import FakeClock
from tests.support.cluster import cache_node, start_cache_nodes
from tests.support.disk import small_disk
from tests.support.metrics import metric_in, series
from tests.support.procs import Service, free_port
from tests.support.redis import RedisServer
from tests.support.waits import eventually

STARTUP_TIMEOUT_S = 20.0


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["memory", "redis"])
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    args = ("--redis", request.getfixturevalue("redis_server").url) if request.param == "redis" else ()
    (proc,) = start_cache_nodes(1, *args, log_dir=tmp_path_factory.mktemp("node"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def memory_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    (proc,) = start_cache_nodes(1, log_dir=tmp_path_factory.mktemp("node"))
    yield proc
    proc.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as c:
        yield c


def sid() -> str:
    return f"s-{uuid.uuid4().hex}"


def record(version: int = 1, owner: str = "key-a", n: int = 2, **extra: object) -> dict[str, object]:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(n)]
    return {"owner": owner, "messages": messages, "version": version, **extra}


# -- storage behaviour (both backends) ------------------------------------------------------


def test_put_then_get_roundtrip(node: Service, client: httpx.Client) -> None:
    s = sid()
    r = client.put(f"{node.url}/v1/sessions/{s}", json=record(version=3, ttl_s=60))
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 3
    got = client.get(f"{node.url}/v1/sessions/{s}")
    assert got.status_code == 200
    body = got.json()
    assert body["session_id"] == s and body["owner"] == "key-a" and body["version"] == 3
    assert body["messages"] == record()["messages"]
    assert abs(body["updated_at"] - time.time()) < 5
    assert 50 < body["expires_at"] - time.time() <= 60
    assert Transcript.from_wire(body).messages[1] == {"role": "assistant", "content": "turn 1"}


def test_missing_session_is_404_in_openai_shape(node: Service, client: httpx.Client) -> None:
    assert_openai_error(client.get(f"{node.url}/v1/sessions/{sid()}"), 404, "session_not_found")


def test_lower_version_is_refused_with_stored_version(node: Service, client: httpx.Client) -> None:
    s = sid()
    url = f"{node.url}/v1/sessions/{s}"
    assert client.put(url, json=record(version=5, n=4)).status_code == 200
    err = assert_openai_error(client.put(url, json=record(version=4, n=1)), 409, "session_version_conflict")
    assert err["stored_version"] == 5
    assert len(client.get(url).json()["messages"]) == 4  # the stale write changed nothing
    assert client.put(url, json=record(version=5, n=3)).status_code == 200  # same version: replication
    assert client.put(url, json=record(version=6, n=6)).status_code == 200
    assert client.get(url).json()["version"] == 6


def test_a_turns_write_of_a_version_already_stored_is_refused(node: Service, client: httpx.Client) -> None:
    """`only_newer` (a gateway's turn): the second write of one version is another gateway's turn on the
    same history, refused on both backends; a newer one, or one onto a node that lacks it, is stored."""
    url = f"{node.url}/v1/sessions/{sid()}"
    assert client.put(url, json=record(version=2, n=4, only_newer=True)).status_code == 200  # nothing stored yet
    err = assert_openai_error(client.put(url, json=record(version=2, n=3, only_newer=True)), 409,
                              "session_version_conflict")
    assert err["stored_version"] == 2 and len(client.get(url).json()["messages"]) == 4
    assert client.put(url, json=record(version=3, n=6, only_newer=True)).status_code == 200
    assert client.get(url).json()["version"] == 3


def test_ttl_expiry(node: Service, client: httpx.Client) -> None:
    """There until its TTL passes, then a 404. The read right after the write is held to 200 only when it
    was answered within the TTL: with a 0.3 s TTL, a test process descheduled between the two on a loaded
    machine read the 404 first; and the expiry is waited for, not slept for."""
    s = sid()
    url = f"{node.url}/v1/sessions/{s}"
    ttl_s = 1.0
    t0 = time.monotonic()
    assert client.put(url, json=record(ttl_s=ttl_s)).status_code == 200
    r = client.get(url)
    if time.monotonic() - t0 < ttl_s:  # the record expires no sooner than ttl_s after t0
        assert r.status_code == 200, r.text
    eventually(lambda: client.get(url).status_code == 404, 10, what="the session expired")
    assert_openai_error(client.get(url), 404, "session_not_found")


def test_delete(node: Service, client: httpx.Client) -> None:
    url = f"{node.url}/v1/sessions/{sid()}"
    assert client.put(url, json=record()).status_code == 200
    assert client.delete(url).json()["deleted"] is True
    assert client.get(url).status_code == 404
    assert client.delete(url).json()["deleted"] is False


def test_a_delete_with_if_version_removes_only_that_version(node: Service, client: httpx.Client) -> None:
    """What the gateway sends to remove a copy left on a node that held a record while its replica was away
    (data_plane/cache/client.py): only the version it saw there, never a write that landed since; a tombstone's
    version (2**53 - 1) too, which Redis' Lua reads as a double."""
    from data_plane.cache.model import TOMBSTONE_VERSION

    url = f"{node.url}/v1/sessions/{sid()}"
    assert client.put(url, json=record(version=3)).status_code == 200
    assert client.delete(url, params={"if_version": 2}).json() == {"session_id": url.rsplit("/", 1)[1],
                                                                   "deleted": False, "stored_version": 3}
    assert client.get(url).json()["version"] == 3
    assert client.delete(url, params={"if_version": 3}).json()["deleted"] is True
    assert client.get(url).status_code == 404
    assert client.delete(url, params={"if_version": 3}).json() == {"session_id": url.rsplit("/", 1)[1],
                                                                   "deleted": False}
    assert client.put(url, json=record(version=TOMBSTONE_VERSION, n=0)).status_code == 200
    assert client.delete(url, params={"if_version": TOMBSTONE_VERSION - 1}).json()["deleted"] is False
    assert client.delete(url, params={"if_version": TOMBSTONE_VERSION}).json()["deleted"] is True
    for bad in ("-1", "x", str(2**53), ""):
        assert_openai_error(client.delete(url, params={"if_version": bad}), 400, "invalid_value")
    # the gateway's form (a node of before it refuses the path, where it ignored the query and removed the record)
    assert client.put(url, json=record(version=5)).status_code == 200
    assert client.delete(f"{url}/if-version/4").json()["stored_version"] == 5
    assert client.delete(f"{url}/if-version/5").json()["deleted"] is True
    assert client.get(url).status_code == 404
    assert_openai_error(client.delete(f"{url}/if-version/x"), 400, "invalid_value")


@pytest.mark.parametrize("bad", ["a%20b", "x" * 129, "a/b", "%C3%A9t%C3%A9", "semi;colon", "%00"])
def test_bad_session_ids_are_400(node: Service, client: httpx.Client, bad: str) -> None:
    url = f"{node.url}/v1/sessions/{bad}"
    for resp in (client.get(url), client.put(url, json=record()), client.delete(url)):
        assert_openai_error(resp, 400, "invalid_session_id")


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"{not json", {"content-type": "application/json"}, 400),
        (b"", {"content-type": "application/json"}, 400),
        (b"[1, 2]", {"content-type": "application/json"}, 400),
        (json.dumps({**record(), "version": "1"}).encode(), {"content-type": "application/json"}, 400),
        (json.dumps(record(version=-1)).encode(), {"content-type": "application/json"}, 400),
        (json.dumps(record(ttl_s=0)).encode(), {"content-type": "application/json"}, 400),
        (json.dumps(record(owner="")).encode(), {"content-type": "application/json"}, 400),
        (json.dumps({"messages": [], "version": 1}).encode(), {"content-type": "application/json"}, 400),
        (json.dumps({**record(), "messages": [{"role": "user", "content": 3}]}).encode(), {}, 400),
        (json.dumps({**record(), "messages": [{"role": "user"}]}).encode(), {}, 400),
        (json.dumps({**record(), "messages": "hi"}).encode(), {}, 400),
        (json.dumps({**record(), "surprise": 1}).encode(), {}, 400),
        (b"\xff\xfe garbage", {"content-type": "application/json"}, 400),
        (json.dumps(record()).encode(), {"content-type": "text/plain"}, 415),
    ],
)
def test_bad_bodies_are_4xx_never_500(
    node: Service, client: httpx.Client, content: bytes, headers: dict[str, str], status: int
) -> None:
    resp = client.put(f"{node.url}/v1/sessions/{sid()}", content=content, headers=headers)
    assert_openai_error(resp, status)


def test_oversized_body_is_413(node: Service, client: httpx.Client) -> None:
    huge = record()
    huge["messages"] = [{"role": "user", "content": "x" * (4 * 1024 * 1024 + 10)}]
    payload = json.dumps(huge).encode()
    url = f"{node.url}/v1/sessions/{sid()}"
    assert_openai_error(client.put(url, content=payload, headers={"content-type": "application/json"}), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the node must count as it reads
        for i in range(0, len(payload), 256 * 1024):
            yield payload[i : i + 256 * 1024]

    assert_openai_error(client.put(url, content=chunked(), headers={"content-type": "application/json"}), 413)
    assert client.get(url).status_code == 404
    assert client.get(f"{node.url}/health").status_code == 200


def test_metrics_follow_requests(node: Service, client: httpx.Client) -> None:
    """Each request moves its own counter by one, each op's latency count by its calls, and (in
    memory; a Redis-backed node re-counts its keys every 10 s) the gauges by the stored record."""
    before = client.get(f"{node.url}/metrics").text
    url = f"{node.url}/v1/sessions/{sid()}"
    client.put(url, json=record(version=2))
    client.put(url, json=record(version=1))
    stored = client.get(url).json()
    client.get(f"{node.url}/v1/sessions/{sid()}")
    client.get(f"{node.url}/v1/sessions/bad%20id")
    after = client.get(f"{node.url}/metrics").text

    def delta(name: str, **labels: str) -> float:
        assert series(after, name, **labels), f"no series {name}{labels}"
        return metric_in(after, name, **labels) - metric_in(before, name, **labels)

    requests = "switchboard_cache_requests_total"
    assert [delta(requests, op="put", result="stored"), delta(requests, op="put", result="stale")] == [1, 1]
    assert [delta(requests, op="get", result=r) for r in ("hit", "miss", "error")] == [1, 1, 1]
    assert [delta(requests, op="put", result="error"), delta(requests, op="delete", result="hit")] == [0, 0]
    assert delta("switchboard_cache_op_seconds_count", op="get") == 3
    assert delta("switchboard_cache_op_seconds_count", op="put") == 2
    for reason in ("ttl", "lru"):
        assert delta("switchboard_cache_evictions_total", reason=reason) == 0
    if "--redis" not in node.args:
        assert delta("switchboard_cache_entries") == 1
        assert delta("switchboard_cache_bytes") == len(encode_record(Transcript.from_wire(stored)))


def test_incoming_traceparent_is_continued(node: Service, client: httpx.Client) -> None:
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    missing = sid()
    miss = client.get(f"{node.url}/v1/sessions/{missing}", headers=headers)
    assert_openai_error(miss, 404, "session_not_found")
    # The miss's error names the caller's trace; it opened no trace of its own (a root span per miss,
    # `http.request.invalid`, that no gateway trace led to).
    assert miss.json()["error"]["trace_id"] == miss.headers["x-trace-id"] == trace_id
    strays = [s for s in client.get(f"{node.url}/debug/spans").json()
              if missing in json.dumps(s) and s["trace_id"] != trace_id]
    assert not strays, strays
    spans = {
        s["span_id"]: s for s in client.get(f"{node.url}/debug/spans", params={"trace_id": trace_id}).json()
    }
    (ours,) = [s for s in spans.values() if s["name"] == "cache_node.get"]
    assert ours["attributes"]["switchboard.cache.result"] == "miss"
    # Ours hangs off the caller's span, directly or under the framework's server span.
    up = ours["parent_span_id"]
    while up in spans:
        up = spans[up]["parent_span_id"]
    assert up == parent


def test_a_refused_put_leaves_its_transcript_out_of_the_spans(node: Service, client: httpx.Client) -> None:
    """A put that does not validate was recorded on its span as pydantic's error, whose words carry the
    whole body: the transcript's text sat in /debug/spans (and went to any OTLP collector)."""
    canary = f"canary-{uuid.uuid4().hex}"
    session = sid()
    refused = client.put(f"{node.url}/v1/sessions/{session}",
                         json={"owner": 5, "messages": [{"role": "user", "content": canary}]})
    assert_openai_error(refused, 400)
    spans = client.get(f"{node.url}/debug/spans").json()
    assert any(session in json.dumps(s) for s in spans)  # the put was traced
    assert canary not in json.dumps(spans)


def test_a_request_refused_before_its_route_stays_in_the_callers_trace(node: Service, client: httpx.Client) -> None:
    """FastAPI refuses the query before the route opens its span: the error's own span continues the
    caller's traceparent (it was a root, a trace the caller's never led to, named in the error body)."""
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    refused = client.put(f"{node.url}/v1/kv/sessions/{sid()}", params={"ttl_s": "-1"}, content=b"x",
                         headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert_openai_error(refused, 400)
    assert refused.json()["error"]["trace_id"] == trace_id
    (span,) = client.get(f"{node.url}/debug/spans", params={"trace_id": trace_id}).json()
    assert span["name"] == "http.request.invalid" and span["parent_span_id"] == parent


# -- in-memory backend specifics ------------------------------------------------------------


def test_lru_eviction_by_bytes(tmp_path: Path, client: httpx.Client) -> None:
    (small,) = start_cache_nodes(1, "--max-bytes", "4096", log_dir=tmp_path)
    try:
        ids = [f"lru-{i}" for i in range(6)]
        for i, s in enumerate(ids):  # ~900 bytes each: the fifth does not fit beside four
            body = record(n=1)
            body["messages"] = [{"role": "user", "content": "y" * 800}]
            assert client.put(f"{small.url}/v1/sessions/{s}", json=body).status_code == 200
            if i == 3:
                assert client.get(f"{small.url}/v1/sessions/{ids[0]}").status_code == 200  # now recent
        present = [s for s in ids if client.get(f"{small.url}/v1/sessions/{s}").status_code == 200]
        assert ids[0] in present and ids[1] not in present and ids[5] in present
        text = client.get(f"{small.url}/metrics").text
        assert metric_in(text, "switchboard_cache_bytes") <= 4096
        assert metric_in(text, "switchboard_cache_entries") == len(present)
        assert metric_in(text, "switchboard_cache_evictions_total", reason="lru") >= 2
        too_big = record()
        too_big["messages"] = [{"role": "user", "content": "z" * 5000}]
        assert_openai_error(
            client.put(f"{small.url}/v1/sessions/huge", json=too_big), 413, "record_too_large"
        )
    finally:
        small.stop()


def test_one_owner_filling_the_store_evicts_its_own_records_not_another_tenants(tmp_path: Path,
                                                                               client: httpx.Client) -> None:
    """One free key storing ~1.1 MB per request (chat completions with `store: true`, Responses turns: the
    messages past the context window cost it ~40 tokens) at 60 requests a minute pushed every other tenant's
    sessions, conversations and stored responses out of a 256 MiB node within minutes (a global LRU)."""
    (small,) = start_cache_nodes(1, "--max-bytes", "8192", log_dir=tmp_path)
    try:
        def put(session_id: str, owner: str) -> None:
            body = record(owner=owner, n=1)
            body["messages"] = [{"role": "user", "content": "y" * 800}]
            assert client.put(f"{small.url}/v1/sessions/{session_id}", json=body).status_code == 200

        victims = [f"victim-{i}" for i in range(2)]
        for s in victims:
            put(s, "victim-key")
        flood = [f"flood-{i}" for i in range(40)]
        for s in flood:
            put(s, "attacker-key")
        assert all(client.get(f"{small.url}/v1/sessions/{s}").status_code == 200 for s in victims)
        kept = [s for s in flood if client.get(f"{small.url}/v1/sessions/{s}").status_code == 200]
        assert kept and kept == flood[-len(kept):]  # the flood's own oldest went, newest first kept
        put("victim-2", "victim-key")  # the victim writes again: room is made from the largest holder
        assert all(client.get(f"{small.url}/v1/sessions/{s}").status_code == 200 for s in [*victims, "victim-2"])
        assert metric_in(client.get(f"{small.url}/metrics").text, "switchboard_cache_bytes") <= 8192
    finally:
        small.stop()


async def test_memory_storage_evicts_the_largest_owners_least_recent_record() -> None:
    def rec(s: str) -> Transcript:  # the owner is the id's first letter
        return Transcript(s, s[0], ({"role": "user", "content": "q" * 500},), 1, 0.0)

    store = MemoryStorage(5 * len(encode_record(rec("a1"))))
    for s in ("a1", "a2", "b1", "b2", "b3"):  # full; a's records are the least recent of all
        await store.put(rec(s), ttl_s=100)
    await store.put(rec("b4"), ttl_s=100)  # b holds the most (3 of 5): its least recent goes, not a1
    await store.put(rec("c1"), ttl_s=100)  # b still holds the most: b2
    await store.get("b3")  # b's least recent is now b4
    await store.put(rec("b5"), ttl_s=100)
    kept = {s for s in ("a1", "a2", "b1", "b2", "b3", "b4", "b5", "c1") if await store.get(s) is not None}
    assert kept == {"a1", "a2", "b3", "b5", "c1"}, kept
    await store.delete("b3")
    await store.put(rec("a3"), ttl_s=100)  # room again: nothing evicted
    assert store.stats().entries == 5


async def test_memory_storage_ttl_lru_and_sweep_with_a_fake_clock() -> None:
    clock = FakeClock(1000.0)
    evictions: list[tuple[str, int]] = []
    store = MemoryStorage(3000, on_evict=lambda r, n: evictions.append((r, n)), clock=clock)

    def rec(s: str, version: int = 1, size: int = 500) -> Transcript:
        return Transcript(s, "o", ({"role": "user", "content": "q" * size},), version, clock.now)

    assert (await store.put(rec("a"), ttl_s=10)).stored
    assert (await store.put(rec("b"), ttl_s=100)).stored
    assert not (await store.put(rec("b", version=0), ttl_s=100)).stored
    clock.now += 11
    assert await store.get("a") is None and evictions == [("ttl", 1)]
    for s in "cdefg":
        await store.put(rec(s), ttl_s=100)
    assert store.stats().bytes <= 3000 and await store.get("b") is None
    assert ("lru", 1) in evictions
    live = store.stats().entries
    clock.now += 200
    assert store.sweep() == live and ("ttl", live) in evictions
    assert (store.stats().entries, store.stats().bytes) == (0, 0)


async def test_memory_storage_expired_record_does_not_block_a_lower_version() -> None:
    clock = FakeClock(0.0)
    store = MemoryStorage(10_000, clock=clock)
    await store.put(Transcript("s", "o", (), 9, 0.0), ttl_s=1)
    clock.now = 2
    assert (await store.put(Transcript("s", "o", (), 1, 2.0), ttl_s=1)).stored


async def test_one_bad_byte_in_a_snapshot_costs_its_record_not_the_file(tmp_path: Path) -> None:
    """A byte that is not UTF-8 (a flipped bit, a line cut inside a character) made the whole file
    unreadable: the node started empty, and its next write replaced the file with an empty one."""
    path = tmp_path / "cache-0.jsonl"
    store = MemoryStorage(1 << 20, snapshot=Snapshot(path))
    await store.start()
    for i in range(3):
        await store.put(Transcript(f"sess{i}", "owner", ({"role": "sealed", "content": f"sb1.k1.n.c{i}"},), 1,
                                   time.time()), ttl_s=3600)
    await store.aclose()
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"c2")] = 0xFF
    path.write_bytes(bytes(raw))
    again = MemoryStorage(1 << 20, snapshot=Snapshot(path))
    await again.start()
    kept = [s for s in ("sess0", "sess1", "sess2") if await again.get(s) is not None]
    await again.aclose()
    assert kept == ["sess0", "sess1"], kept
    # the damaged file is kept as it was (its next write, here the stop's, dropped sess2 for good)
    aside = path.with_name(path.name + ".corrupt")
    assert aside.read_bytes() == bytes(raw), "the damaged snapshot was overwritten, sess2 unrecoverable"
    assert aside.stat().st_mode & 0o777 == 0o600


async def test_memory_storage_snapshot_keeps_live_records_in_lru_order(tmp_path: Path) -> None:
    """What `switchboard up`'s cache nodes keep across a restart: the unexpired records, least recent
    first (so LRU eviction after the restart drops what it would have before), and a torn line skipped."""
    clock = FakeClock(1000.0)
    snapshot = Snapshot(tmp_path / "cache" / "node.jsonl")

    def rec(s: str) -> Transcript:
        return Transcript(s, "o", ({"role": "user", "content": s * 8},), 3, clock.now)

    store = MemoryStorage(10_000, clock=clock, snapshot=snapshot)
    await store.start()
    for s, ttl in (("a", 100), ("s", 5), ("b", 100)):
        await store.put(rec(s), ttl_s=ttl)
    await store.get("a")  # now the most recent
    await store.aclose()
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    assert snapshot.path.stat().st_mode & 0o777 == 0o600
    with snapshot.path.open("a") as f:
        f.write('{"record": {"session_id": "torn"\n')
    stale = snapshot.path.parent / f".{snapshot.path.name}.x1y2.tmp"  # a write cut off by kill -9
    stale.write_text("half a store")
    clock.now += 10
    evictions: list[tuple[str, int]] = []
    room_for_two = 2 * len(encode_record(rec("a")))
    again = MemoryStorage(room_for_two, clock=clock, snapshot=snapshot, on_evict=lambda r, n: evictions.append((r, n)))
    await again.start()
    try:
        assert again.stats().entries == 2 and evictions == []  # "s" expired while down: never restored
        assert not stale.exists()
        await again.put(rec("c"), ttl_s=100)
        assert evictions == [("lru", 1)] and await again.get("b") is None  # b was the least recent before
        assert (await again.get("a")).version == 3
    finally:
        await again.aclose()


def test_memory_records_survive_a_restart_and_a_crash_with_a_snapshot_file(tmp_path: Path,
                                                                           client: httpx.Client) -> None:
    """kill -9 loses only what changed in the last --snapshot-interval-s; a clean stop loses nothing,
    a delete included (the record does not come back)."""
    path = tmp_path / "cache-0.jsonl"
    (first,) = start_cache_nodes(1, "--snapshot-file", str(path), "--snapshot-interval-s", "0.2", log_dir=tmp_path)
    kept, dropped = sid(), sid()
    try:
        for s in (kept, dropped):
            assert client.put(f"{first.url}/v1/sessions/{s}", json=record(version=7)).status_code == 200
        eventually(lambda: path.exists() and dropped in path.read_text(), 10, what="the periodic snapshot")
    finally:
        first.kill()
    (second,) = start_cache_nodes(1, "--snapshot-file", str(path), "--snapshot-interval-s", "3600", log_dir=tmp_path)
    try:
        assert client.get(f"{second.url}/v1/sessions/{kept}").json()["version"] == 7
        assert client.put(f"{second.url}/v1/sessions/{kept}", json=record(version=8)).status_code == 200
        assert client.delete(f"{second.url}/v1/sessions/{dropped}").json()["deleted"] is True
    finally:
        second.stop()
    (third,) = start_cache_nodes(1, "--snapshot-file", str(path), log_dir=tmp_path)
    try:
        assert client.get(f"{third.url}/v1/sessions/{kept}").json()["version"] == 8
        assert client.get(f"{third.url}/v1/sessions/{dropped}").status_code == 404
    finally:
        third.stop()


def test_a_snapshot_disk_that_fills_up_is_reported_and_the_old_file_kept(tmp_path: Path, client: httpx.Client) -> None:
    """The snapshot's disk fills up (a tmpfs, for real): the node keeps serving from memory, says so in a
    metric an alert reads (it was a log line only), keeps the last good file whole, and writes again
    once there is room."""
    with small_disk(tmp_path / "disk", size="256k") as disk:
        path = disk.path / "cache-0.jsonl"
        (node,) = start_cache_nodes(1, "--snapshot-file", str(path), "--snapshot-interval-s", "0.2",
                                    log_dir=tmp_path)
        try:
            first, second = sid(), sid()
            assert client.put(f"{node.url}/v1/sessions/{first}", json=record(version=1)).status_code == 200
            eventually(lambda: path.exists() and first in path.read_text(), 10, what="the first snapshot")
            good = path.read_bytes()
            disk.fill()
            assert client.put(f"{node.url}/v1/sessions/{second}", json=record(version=1)).status_code == 200
            eventually(lambda: metric_in(httpx.get(node.url + "/metrics").text,
                                         "switchboard_cache_snapshot_failing") == 1, 10, what="the failure reported")
            text = httpx.get(node.url + "/metrics").text
            assert metric_in(text, "switchboard_cache_snapshot_writes_total", result="error") >= 1
            assert path.read_bytes() == good
            assert client.get(f"{node.url}/v1/sessions/{second}").json()["version"] == 1  # served from memory
            disk.free()
            eventually(lambda: second in path.read_text(), 10, what="the snapshot written again")
            eventually(lambda: metric_in(httpx.get(node.url + "/metrics").text,
                                         "switchboard_cache_snapshot_failing") == 0, 10, what="the failure cleared")
        finally:
            node.stop()


# -- Redis backend specifics ----------------------------------------------------------------


def test_redis_records_survive_a_node_restart(redis_server: RedisServer, tmp_path: Path,
                                              client: httpx.Client) -> None:
    args = ("--redis", redis_server.url, "--node-id", f"cache-restart-{uuid.uuid4().hex[:6]}")
    (first,) = start_cache_nodes(1, *args, log_dir=tmp_path)
    s = sid()
    try:
        assert client.put(f"{first.url}/v1/sessions/{s}", json=record(version=7)).status_code == 200
    finally:
        first.kill()
    (second,) = start_cache_nodes(1, *args, log_dir=tmp_path)
    try:
        assert client.get(f"{second.url}/v1/sessions/{s}").json()["version"] == 7
    finally:
        second.stop()


def test_redis_down_is_503_not_500(tmp_path: Path, client: httpx.Client) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = cache_node("--redis", dead, log_dir=tmp_path).start(wait=False)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # /health answers 503 here, so wait for any answer
            try:
                health = client.get(f"{proc.url}/health")
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log_tail()
                time.sleep(0.05)
        assert health.status_code == 503
        assert_openai_error(client.get(f"{proc.url}/v1/sessions/{sid()}"), 503, "cache_backend_unavailable")
        resp = client.put(f"{proc.url}/v1/sessions/{sid()}", json=record())
        assert_openai_error(resp, 503, "cache_backend_unavailable")
        assert resp.headers["retry-after"] == "1"
    finally:
        proc.stop()


# -- configuration and registration ---------------------------------------------------------


def test_settings_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_CACHE_TTL_S", "5")
    monkeypatch.setenv("SWITCHBOARD_CACHE_MAX_BYTES", "2048")
    s = parse_settings(["--port", "9999", "--max-bytes", "4096", "--node-id", "c1"])
    assert (s.port, s.ttl_s, s.max_bytes, s.member_id, s.url) == (
        9999,
        5.0,
        4096,
        "c1",
        "http://127.0.0.1:9999",
    )
    with pytest.raises(SystemExit):
        parse_settings(["--max-bytes", "10"])


class _RegistryStub(http.server.BaseHTTPRequestHandler):
    """An HTTP stub of the membership registry's two write calls, recording what it hears."""

    calls: ClassVar[list[tuple[str, str, dict[str, object] | None]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        type(self).calls.append((self.command, self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    do_PUT = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_registers_as_cache_and_deregisters_on_shutdown(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RegistryStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        (proc,) = start_cache_nodes(1, "--registry-url", registry, "--node-id", "cache-reg-1", log_dir=tmp_path)
        proc.stop()  # SIGTERM: uvicorn runs the lifespan shutdown, which deregisters
        puts = [c for c in _RegistryStub.calls if c[0] == "PUT"]
        assert puts and puts[0][1] == "/v1/registry/members/cache-reg-1"
        assert puts[0][2] is not None and puts[0][2]["service"] == "cache"
        assert puts[0][2]["url"] == proc.url
        assert _RegistryStub.calls[-1][:2] == ("DELETE", "/v1/registry/members/cache-reg-1")
    finally:
        server.shutdown()


def test_a_stalled_redis_is_a_prompt_503(tmp_path: Path, client: httpx.Client) -> None:
    """A Redis that accepts connections and answers nothing (a partition dropping packets, a long fork)
    made /health take the client's whole 2 s socket timeout: past `switchboard up`'s 1 s liveness probe,
    so after 30 s every cache node was SIGKILLed as hung though it was up and saying why. /health answers
    503 within READY_TIMEOUT_S instead."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes the handshakes; nobody reads or answers
    proc = cache_node("--redis", f"redis://127.0.0.1:{silent.getsockname()[1]}/0", log_dir=tmp_path).start(wait=False)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                client.get(f"{proc.url}/health")
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
                time.sleep(0.05)
        for _ in range(2):
            began = time.monotonic()
            health = client.get(f"{proc.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert time.monotonic() - began < LIVENESS_PROBE_TIMEOUT_S, "slower than up's liveness probe waits"
    finally:
        proc.stop()
        silent.close()


async def test_memory_storage_never_evicts_the_record_it_was_just_given() -> None:
    """A new owner whose first record is larger than any other owner's holds the most at once: its record was
    the one evicted, and the PUT still answered stored (a turn's conversation gone the moment it was saved)."""
    def rec(s: str, size: int = 500) -> Transcript:  # the owner is the id's first letter
        return Transcript(s, s[0], ({"role": "user", "content": "q" * size},), 1, 0.0)

    store = MemoryStorage(5 * len(encode_record(rec("a1"))))
    for s in ("a1", "b1", "c1", "d1", "e1"):  # full, one small record an owner
        await store.put(rec(s), ttl_s=100)
    assert (await store.put(rec("z1", size=1200), ttl_s=100)).stored
    assert await store.get("z1") is not None  # room made from the others, least recent first
    assert await store.get("a1") is None and await store.get("e1") is not None
    assert store.stats().bytes <= store.max_bytes
    small = MemoryStorage(100)  # a record past the store's size, as a snapshot restored under a lower limit
    small._insert(rec("y1"), len(encode_record(rec("y1"))), 100.0)
    assert small.stats().entries == 0
