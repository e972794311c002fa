"""The usage ledger: the store (SQLite and PostgreSQL), the spool, and real gateways writing it.

    .venv/bin/python -m pytest tests/data_plane/test_ledger.py -q

PostgreSQL tests start a throwaway server (tests/support/postgres.py) and skip when it is not installed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from data_plane.ledger.store import MIGRATIONS, UsageQuery, open_ledger_store
from data_plane.ledger.writer import LedgerMetrics, Spool, UsageLedger, read_segment
from tests.support.cluster import ADMIN_TOKEN, KEYS, Cluster, api_keys_env
from tests.support.disk import SmallDisk, small_disk
from tests.support.ledger import usage_record
from tests.support.metrics import metric
from tests.support.postgres import PostgresServer
from tests.support.procs import Service


@pytest.fixture(scope="module")
def postgres():
    with PostgresServer() as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'usage.db'}"
    return request.getfixturevalue("postgres").create_database("store")


def test_migrations_are_versioned_and_applied_once(store_url: str) -> None:
    store = open_ledger_store(store_url)
    assert store.migrate() == MIGRATIONS[-1][0]
    assert store.migrate() == MIGRATIONS[-1][0]  # the second run applies nothing
    rows = store._run(lambda conn: conn.execute("SELECT version FROM schema_version").fetchall())  # type: ignore[attr-defined]
    assert sorted(r[0] for r in rows) == [v for v, _, _ in MIGRATIONS]
    store.close()


def test_inserts_are_idempotent_and_reads_group_and_filter(store_url: str) -> None:
    store = open_ledger_store(store_url)
    store.migrate()
    hour = 3600 * (int(time.time()) // 3600)
    records = [usage_record(1, started_at=hour + 10), usage_record(2, started_at=hour + 20, tier="free", status=429,
                                                          error_code="rate_limit_exceeded", prompt_tokens=0,
                                                          completion_tokens=0, cached_tokens=0),
               usage_record(3, started_at=hour - 100, tenant="bigco", key_id="k2", tier="enterprise")]
    assert store.insert_many([r.as_row() for r in records]) == 3
    assert store.insert_many([r.as_row() for r in records]) == 0  # a replayed spool adds nothing
    out = store.usage(UsageQuery(bucket_s=3600, group_by=("tenant", "tier")))
    assert out["totals"] == {"requests": 3, "errors": 1, "prompt_tokens": 20, "cached_tokens": 4,
                             "completion_tokens": 10}
    assert next((r["start"], r["tenant"], r["tier"]) for r in out["rows"]) == (hour - 3600, "bigco", "enterprise")
    assert {(r["tenant"], r["tier"]) for r in out["rows"]} == {("bigco", "enterprise"), ("acme", "plus"),
                                                               ("acme", "free")}
    acme = store.usage(UsageQuery(tenant="acme", start=hour, end=hour + 3600))
    assert acme["totals"]["requests"] == 2 and len(acme["rows"]) == 1
    assert store.usage(UsageQuery(key_id="k2"))["totals"]["prompt_tokens"] == 10
    with pytest.raises(ValueError):
        store.usage(UsageQuery(group_by=("prompt",)))
    assert store.prune(before=hour) == 1
    assert store.usage(UsageQuery())["totals"]["requests"] == 2
    store.close()


def test_spool_survives_a_crash_and_replays_once(tmp_path: Path) -> None:
    """A ledger that never flushed (the process died): the next one on the same spool writes
    every record; a segment replayed after it was written adds no duplicate."""
    db = f"sqlite:///{tmp_path / 'usage.db'}"

    async def crash_run() -> None:
        ledger = UsageLedger(open_ledger_store(db), Spool(tmp_path / "spool"), LedgerMetrics(CollectorRegistry()),
                             gateway="gw", flush_interval_s=3600)
        await ledger.start()
        for i in range(50):
            ledger.record(usage_record(i))
        os.close(ledger.spool._lock_fd)  # "killed": no flush, the lock released

    asyncio.run(crash_run())
    segment = next((tmp_path / "spool").glob("*.jsonl"))
    assert len(read_segment(segment)) == 50
    copy = segment.read_bytes()

    async def restart() -> tuple[float, float]:
        registry = CollectorRegistry()
        ledger = UsageLedger(open_ledger_store(db), Spool(tmp_path / "spool"), LedgerMetrics(registry), gateway="gw")
        await ledger.start()
        assert registry.get_sample_value("switchboard_ledger_spool_records") == 50
        assert await ledger.flush()
        (tmp_path / "spool" / "again.jsonl").write_bytes(copy + b'{"torn')  # replayed + a torn line
        assert await ledger.flush()
        await ledger.aclose()
        return (registry.get_sample_value("switchboard_ledger_records_total", {"outcome": "written"}) or 0,
                registry.get_sample_value("switchboard_ledger_records_total", {"outcome": "duplicate"}) or 0)

    assert asyncio.run(restart()) == (50, 50)
    assert open_ledger_store(db).usage(UsageQuery())["totals"]["requests"] == 50
    assert not list((tmp_path / "spool").glob("*.jsonl"))


def test_a_spool_has_one_owner_and_orphans_are_adopted(tmp_path: Path) -> None:
    live = Spool(tmp_path / "a")
    with pytest.raises(SystemExit):
        Spool(tmp_path / "a")
    dead = Spool(tmp_path / "b")
    dead.append(b'{"x": 1}\n')
    dead.close()  # released, as a kill -9 releases it
    elsewhere = Spool(tmp_path / "d", target="another-db")
    elsewhere.append(b'{"x": 2}\n')
    elsewhere.close()
    mine = Spool(tmp_path / "c")
    assert mine.adopt_orphans() == 1  # b's segment; a is held, d is bound for another database
    assert (tmp_path / "a").exists() and not (tmp_path / "b").exists() and (tmp_path / "d").exists()
    assert len(mine.segments()) == 1
    live.close()
    mine.close()


def test_retention_prunes_old_records_after_a_flush(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    open_ledger_store(db).migrate()

    async def run() -> None:
        ledger = UsageLedger(open_ledger_store(db), Spool(tmp_path / "s"), LedgerMetrics(CollectorRegistry()),
                             gateway="gw", flush_interval_s=0.05, retention_days=30)
        await ledger.start()
        ledger.record(usage_record(1, started_at=time.time() - 31 * 86400))
        ledger.record(usage_record(2))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if open_ledger_store(db).usage(UsageQuery())["totals"]["requests"] == 1:
                break
        await ledger.aclose()

    asyncio.run(run())
    assert open_ledger_store(db).usage(UsageQuery())["totals"]["requests"] == 1


def test_an_idle_gateway_prunes_a_new_database_without_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: the first prune ran before any record was written, so before the migration (done
    by the first write): every fresh `switchboard up` logged 'no such table: usage_records'."""
    db = f"sqlite:///{tmp_path / 'usage.db'}"

    async def run() -> None:
        ledger = UsageLedger(open_ledger_store(db), Spool(tmp_path / "s"), LedgerMetrics(CollectorRegistry()),
                             gateway="gw", flush_interval_s=0.05, retention_days=30)
        await ledger.start()
        deadline = time.monotonic() + 10  # the first idle flush round prunes (later on a loaded host)
        while "schema version" not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # a few more rounds
        await ledger.aclose()

    with caplog.at_level(logging.INFO, logger="data_plane.ledger.writer"):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "schema version" in caplog.text
    assert open_ledger_store(db).usage(UsageQuery())["totals"]["requests"] == 0


def test_a_usage_read_before_anything_was_written_is_empty_not_an_error(tmp_path: Path) -> None:
    """Review: GET /v1/usage on a new database (the first second after start, or until the first
    request with retention off) read before the migration: 'no such table', a 500."""
    async def run() -> dict:
        ledger = UsageLedger(open_ledger_store(f"sqlite:///{tmp_path / 'usage.db'}"), Spool(tmp_path / "s"),
                             LedgerMetrics(CollectorRegistry()), gateway="gw", retention_days=0)
        try:
            return await ledger.usage(UsageQuery())
        finally:
            await ledger.aclose()

    assert asyncio.run(run())["totals"]["requests"] == 0


def test_a_database_that_is_down_keeps_records_spooled(tmp_path: Path) -> None:
    async def run() -> None:
        registry = CollectorRegistry()
        ledger = UsageLedger(open_ledger_store("postgresql://nobody@127.0.0.1:1/none"), Spool(tmp_path / "s"),
                             LedgerMetrics(registry), gateway="gw")
        await ledger.start()
        ledger.record(usage_record(1))
        assert not await ledger.flush()
        assert registry.get_sample_value("switchboard_ledger_write_failures_total") == 1
        assert registry.get_sample_value("switchboard_ledger_spool_records") == 1
        await ledger.aclose()

    asyncio.run(run())
    assert len(list((tmp_path / "s").glob("*.jsonl"))) == 1


# -- real gateways -------------------------------------------------------------------------------


def _client_usage(gateway: str, tier: str, *, stream: bool, session: str | None = None,
                  text: str = "hello there friend") -> tuple[str, dict[str, int], str | None]:
    """One chat request: (request id, usage the client saw, session id)."""
    headers = {"Authorization": f"Bearer {KEYS[tier]}"}
    if session:
        headers["X-Session-Id"] = session
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        usage: dict[str, int] = {}
        with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        return r.headers["x-request-id"], usage, r.headers.get("x-session-id")
    r = httpx.post(gateway + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()["usage"], r.headers.get("x-session-id")


def _traffic(gateway: str) -> dict[str, int]:
    """Streaming, non-streaming, a two-turn session and errors; the totals the clients saw."""
    seen = {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}

    def add(usage: dict[str, int]) -> None:
        seen["requests"] += 1
        seen["prompt_tokens"] += usage["prompt_tokens"]
        seen["completion_tokens"] += usage["completion_tokens"]
        seen["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    for stream in (False, True, False, True):
        add(_client_usage(gateway, "plus", stream=stream)[1])
    _, usage, sid = _client_usage(gateway, "enterprise", stream=False, session="new")
    add(usage)
    add(_client_usage(gateway, "enterprise", stream=True, session=sid)[1])
    for body in ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, {"messages": "nope"}):
        r = httpx.post(gateway + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS['free']}"})
        assert r.status_code == 400
        seen["requests"] += 1
        seen["errors"] += 1
    return seen


def _totals(url: str) -> dict[str, int]:
    store = open_ledger_store(url)
    try:
        return store.usage(UsageQuery())["totals"]
    finally:
        store.close()


def _wait_totals(url: str, requests: int, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            totals = _totals(url)
            if totals["requests"] >= requests or time.monotonic() > deadline:
                return totals
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def test_ledger_totals_equal_what_clients_saw_sqlite(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    with Cluster(shards=1, caches=2, gateway_args=["--usage-db", db, "--usage-flush-interval-s", "0.2",
                                                   "--state-dir", str(tmp_path)]) as c:
        seen = _traffic(c.gateway.url)
        totals = _wait_totals(db, seen["requests"])
        assert {k: totals[k] for k in seen} == seen
        # the key's own view, in OpenAI's usage shape
        r = httpx.get(c.gateway.url + "/v1/usage", params={"bucket_width": "1h"},
                      headers={"Authorization": f"Bearer {KEYS['enterprise']}"})
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["object"] == "page" and page["data"][-1]["object"] == "bucket"
        results = [x for b in page["data"] for x in b["results"]]
        assert sum(x["num_model_requests"] for x in results) == 2  # the session's two turns only
        assert httpx.get(c.gateway.url + "/v1/usage").status_code == 401
        # the operators' view: a control plane on the same database URL
        with Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--usage-db", db]) as cp:
            admin = httpx.get(cp.url + "/admin/v1/usage", params={"group_by": "hour", "by": "tenant,tier"},
                              headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
            assert {k: admin["totals"][k] for k in seen} == seen
            assert {(r["tenant"], r["tier"]) for r in admin["rows"]} == {("acme", "plus"), ("bigco", "enterprise"),
                                                                        ("acme", "free")}
    store = open_ledger_store(db)
    rows = store._run(lambda conn: conn.execute("SELECT * FROM usage_records").fetchall())  # type: ignore[attr-defined]
    assert {r[16] for r in rows} and all(r[9] in (200, 400) for r in rows)
    assert sum(1 for r in rows if r[15]) == 2  # two session turns
    assert all(r[13] == "shard-0" for r in rows if r[9] == 200)


def test_a_stream_the_client_leaves_is_recorded_with_the_tokens_it_used(tmp_path: Path) -> None:
    """Found under load: every client_disconnected record had 0 prompt and 0 completion tokens (usage
    came only with the stream's last chunk), so leaving just before the end made any reply free."""
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    with Cluster(shards=1, caches=1, token_delay_ms=40.0,
                 gateway_args=["--usage-db", db, "--usage-flush-interval-s", "0.2", "--state-dir", str(tmp_path)]) as c:
        body = {"messages": [{"role": "user", "content": "tell me a long story please"}], "max_tokens": 200,
                "stream": True}
        chunks = 0
        with httpx.stream("POST", c.gateway.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEYS['plus']}"}) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    chunks += 1
                if chunks >= 4:
                    break  # leaving closes the connection mid-stream
        whole = httpx.post(c.gateway.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1},
                           headers={"Authorization": f"Bearer {KEYS['plus']}"}, timeout=30).json()["usage"]
        _wait_totals(db, 2)
        store = open_ledger_store(db)
        try:
            def row(conn: Any) -> Any:
                return conn.execute("SELECT status, error_code, prompt_tokens, completion_tokens FROM usage_records "
                                    "WHERE request_id = ?", (request_id,)).fetchone()
            status, code, prompt, completion = store._run(row)  # type: ignore[attr-defined]
        finally:
            store.close()
    assert (status, code) == (499, "client_disconnected")
    assert prompt == whole["prompt_tokens"] > 0  # the prompt it prefilled, as a whole request reports it
    assert 4 <= completion < 200  # what it was sent, at least; not the whole reply


def test_two_gateways_write_one_postgresql(postgres: PostgresServer, tmp_path: Path) -> None:
    url = postgres.create_database("two")
    args = ["--usage-db", url, "--usage-flush-interval-s", "0.2", "--state-dir", str(tmp_path)]
    with Cluster(shards=1, caches=1, gateway_args=args) as c:
        second = Service(["gateway", "--registry-url", c.registry, "--tokenizer", "whitespace", "--model-name",
                          "synthetic", *args], env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        with second:
            seen: list[dict[str, int]] = [{}, {}]
            threads = [threading.Thread(target=lambda i=i, g=g: seen.__setitem__(i, _traffic(g)))
                       for i, g in enumerate((c.gateway.url, second.url))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            want = {k: seen[0][k] + seen[1][k] for k in seen[0]}
            totals = _wait_totals(url, want["requests"])
            assert {k: totals[k] for k in want} == want
    store = open_ledger_store(url)
    gateways = store._run(lambda conn: conn.execute("SELECT DISTINCT gateway FROM usage_records").fetchall())  # type: ignore[attr-defined]
    assert len(gateways) == 2
    store.close()


def test_kill_9_under_load_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """Flushes are 60 s apart, so every record is only in the spool when the gateway is killed:
    each request the client saw complete must be in the database once a new gateway has replayed it."""
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    spool = str(tmp_path / "spool")
    args = ["--usage-db", db, "--usage-flush-interval-s", "60", "--usage-spool-dir", spool]
    acked: list[str] = []
    with Cluster(shards=2, caches=1, gateway_args=args, token_delay_ms=5) as c:
        stop = threading.Event()

        def load(tier: str, stream: bool) -> None:
            while not stop.is_set():
                try:
                    acked.append(_client_usage(c.gateway.url, tier, stream=stream)[0])
                except (httpx.HTTPError, AssertionError, KeyError):
                    pass

        threads = [threading.Thread(target=load, args=(t, s)) for t in ("plus", "enterprise") for s in (True, False)]
        for t in threads:
            t.start()
        # Kill once enough requests are acknowledged (a count, not a fixed sleep: a loaded machine
        # acknowledges 8 in 3 s, an idle one 60), with a minimum of 1 s of load in flight.
        deadline = time.monotonic() + 120
        time.sleep(1.0)
        while len(acked) <= 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        c.gateway.kill()
        stop.set()
        for t in threads:
            t.join()
        assert len(acked) > 20
        restarted = Service(["gateway", "--registry-url", c.registry, "--tokenizer", "whitespace", "--model-name",
                             "synthetic", *args[:-4], "--usage-flush-interval-s", "0.2", "--usage-spool-dir", spool],
                            env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        with restarted:
            _wait_totals(db, len(acked))
    store = open_ledger_store(db)
    stored = {r[0] for r in store._run(lambda conn: conn.execute("SELECT request_id FROM usage_records").fetchall())}  # type: ignore[attr-defined]
    missing = set(acked) - stored
    print(f"LEDGER kill -9: {len(acked)} acknowledged, {len(stored)} stored, {len(missing)} missing")
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged requests have no record"


def test_a_full_spool_disk_loses_no_usage_record(tmp_path: Path) -> None:
    """The gateway's spool on a disk that fills up (a tmpfs, for real) while the database lives elsewhere:
    every request the clients saw is in the ledger, none lost (they were counted `spool_error` and gone);
    no torn line is left in a segment; the held records are reported, and the spool takes records again
    once the disk has room."""
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    with small_disk(tmp_path / "spool", size="256k") as disk, Cluster(shards=1, caches=1, gateway_args=[
            "--usage-db", db, "--usage-flush-interval-s", "0.2", "--usage-spool-dir", str(tmp_path / "spool" / "gw"),
            "--state-dir", str(tmp_path)]) as c:
        seen = _traffic(c.gateway.url)
        assert _wait_totals(db, seen["requests"])["requests"] == seen["requests"]
        disk.fill()
        for stream in (False, True) * 4:
            _client_usage(c.gateway.url, "plus", stream=stream)
        assert metric(c.gateway.url, "switchboard_ledger_records_total", outcome="spool_error") > 0
        assert _wait_totals(db, seen["requests"] + 8)["requests"] == seen["requests"] + 8  # straight to the db
        assert metric(c.gateway.url, "switchboard_ledger_held_records") == 0
        for segment in (tmp_path / "spool" / "gw").glob("*.jsonl"):
            assert all(json.loads(line) for line in segment.read_bytes().splitlines())
        disk.free()
        for stream in (False, True):
            _client_usage(c.gateway.url, "plus", stream=stream)
        assert _wait_totals(db, seen["requests"] + 10)["requests"] == seen["requests"] + 10
        assert metric(c.gateway.url, "switchboard_ledger_records_total", outcome="dropped") == 0


async def _ledger_on_a_full_disk(disk: SmallDisk, db: Path) -> tuple[UsageLedger, CollectorRegistry]:
    """A started ledger (a hold of 5 records) spooling on `disk`, its database at `db`: one record written,
    then the disk filled."""
    registry = CollectorRegistry()
    ledger = UsageLedger(open_ledger_store(f"sqlite:///{db}"), Spool(disk.path / "s"), LedgerMetrics(registry),
                         gateway="gw", held_max=5)
    await ledger.start()
    ledger.record(usage_record(0))
    assert await ledger.flush()
    disk.fill()
    return ledger, registry


def test_records_the_disk_refuses_wait_in_memory_for_it(tmp_path: Path) -> None:
    """Spool and SQLite database on one full disk: the records are held in memory (counted, at most
    `held_max`, the oldest dropped beyond), and all reach the database once the disk has room."""
    async def run(disk: SmallDisk) -> None:
        ledger, registry = await _ledger_on_a_full_disk(disk, disk.path / "usage.db")
        for i in range(1, 8):
            ledger.record(usage_record(i))
        assert registry.get_sample_value("switchboard_ledger_held_records") == 5
        assert registry.get_sample_value("switchboard_ledger_records_total", {"outcome": "dropped"}) == 2
        disk.free()
        assert await ledger.flush()
        assert registry.get_sample_value("switchboard_ledger_held_records") == 0
        assert (await ledger.usage(UsageQuery()))["totals"]["requests"] == 6  # 0 and 3..7
        await ledger.aclose()

    with small_disk(tmp_path / "disk", size="512k") as disk:
        asyncio.run(run(disk))


def test_records_held_while_the_held_ones_go_to_the_database_are_not_lost(tmp_path: Path) -> None:
    """The spool's disk is full, the database lives elsewhere: a flush writes the held records straight to the
    database, in a thread. Records held while that write ran were appended behind them and, the hold full,
    pushed the oldest (being written) out, counted `dropped`; once the write was done as many records were
    taken off the front of the hold as were written: the newer ones, never written nor counted (lost), and
    the held-records gauge read 0 with records still held. The batch is now out of the hold while it is written."""

    async def run(disk: SmallDisk) -> None:
        ledger, registry = await _ledger_on_a_full_disk(disk, tmp_path / "usage.db")
        for i in range(1, 6):  # the hold is full
            ledger.record(usage_record(i))
        entered, go = threading.Event(), threading.Event()
        insert_many = ledger.store.insert_many

        def slow_insert(rows: Any) -> int:  # the database write takes its time
            entered.set()
            go.wait(10)
            return insert_many(rows)

        ledger.store.insert_many = slow_insert  # type: ignore[method-assign]
        flushing = asyncio.ensure_future(ledger.flush())
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        for i in range(6, 9):  # requests go on meanwhile
            ledger.record(usage_record(i))
        go.set()
        await flushing
        ledger.store.insert_many = insert_many  # type: ignore[method-assign]
        assert registry.get_sample_value("switchboard_ledger_held_records") == 3
        assert registry.get_sample_value("switchboard_ledger_records_total", {"outcome": "dropped"}) == 0
        disk.free()
        assert await ledger.flush()
        assert registry.get_sample_value("switchboard_ledger_held_records") == 0
        assert (await ledger.usage(UsageQuery()))["totals"]["requests"] == 9
        await ledger.aclose()

    with small_disk(tmp_path / "disk", size="512k") as disk:
        asyncio.run(run(disk))


def test_a_reader_before_any_gateway_migrated_the_ledger_sees_no_usage_not_an_error(tmp_path: Path) -> None:
    """The control plane reads the ledger (abuse monitor, admin usage API) from its first second, before
    the first gateway created the table: every fresh `switchboard up` logged "abuse monitor: cannot read the
    usage ledger (OperationalError: no such table: usage_records)" and counted an evaluation error. No table
    yet is no usage; other errors still raise."""
    store = open_ledger_store(str(tmp_path / "usage.db"))
    try:
        assert store.activity(0.0, time.time()) == []
        got = store.usage(UsageQuery(group_by=("tenant",)))
        assert got["rows"] == [] and got["totals"]["requests"] == 0
        with pytest.raises(ValueError):
            store.usage(UsageQuery(group_by=("prompt",)))
    finally:
        store.close()


def test_a_usage_read_while_the_database_is_down_is_a_503_not_a_500() -> None:
    """Found with `switchboard up --usage-db postgresql://…`: PostgreSQL stopped, chat kept working (its
    records spooled) but the key's GET /v1/usage was a 500 `internal_error` with a traceback in the log;
    the control plane's /admin/v1/usage already said 503 `usage_db_unavailable`."""
    with Service(["gateway", "--cache-urls", "http://127.0.0.1:1", "--usage-db", "postgresql://nobody@127.0.0.1:1/none"],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()}) as gw:
        r = httpx.get(gw.url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['plus']}"}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "usage_db_unavailable" and r.json()["error"]["type"] == "server_error"
        assert r.headers["retry-after"] == "5"
        assert "Traceback" not in gw.log_tail(50_000)


def test_a_database_url_of_another_scheme_is_refused_in_one_line(tmp_path: Path) -> None:
    """`--usage-db bogus://` (or a typo: `postgresq://…`, `sqlite://x`) was taken for a relative file path:
    `up` said it was up, and each process wrote a SQLite file named `bogus:` in its working folder."""
    import subprocess
    import sys

    for command in ("up", "gateway", "control-plane"):
        ran = subprocess.run([sys.executable, "-m", "control_plane.cli", command, "--usage-db", "postgresq://db/usage"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
        assert ran.stderr.strip().splitlines() == [(
            f"switchboard {command}: --usage-db: unsupported database URL postgresq://...: give sqlite:///PATH, "
            "postgresql://USER@HOST/DB, a file path, or off")], ran.stderr
    assert not list(tmp_path.iterdir())
    from data_plane.ledger.store import check_usage_db

    for fine in (None, "off", "usage.db", "sqlite:////abs/usage.db", "postgres://u@h/db", "postgresql://u@h/db"):
        assert check_usage_db(fine) == fine
