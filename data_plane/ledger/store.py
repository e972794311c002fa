"""The usage ledger's database: SQLite (WAL, embedded, the default) or PostgreSQL (psycopg 3).

    store = open_ledger_store("sqlite:///.switchboard/usage.db")      # or a plain path
    store = open_ledger_store("postgresql://sb@127.0.0.1:5432/switchboard")
    store.migrate()                                  # versioned: schema_version + MIGRATIONS, in order
    store.insert_many([record.as_row(), ...])         # idempotent on request_id (ON CONFLICT DO NOTHING)
    store.usage(UsageQuery(tenant="acme", bucket_s=3600))   # grouped rows + totals
    store.prune(before=time.time() - 30 * 86400)

Every method is synchronous and meant to run in one worker thread per store (the ledger's flusher,
or `asyncio.to_thread` on the read side); a connection is opened on first use and reopened after a
failure, so a database that was down at start is picked up once it is back.

Schema changes are appended to `MIGRATIONS` (never edited once shipped): each is applied once, in
order, inside one transaction that also records its version in `schema_version`. On PostgreSQL the
transaction takes an advisory lock first, so several gateways starting at once migrate once.
No prompt or completion text is ever stored: the record has no column for it.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

COLUMNS = (
    "request_id", "trace_id", "key_id", "tenant", "tier", "model", "prompt_tokens", "cached_tokens",
    "completion_tokens", "status", "error_code", "ttft_s", "latency_s", "shard", "degradation_level",
    "session", "gateway", "started_at", "finished_at", "output_kind", "tool_calls",
)
"""One usage record's columns, in insert order (data_plane/ledger/writer.py UsageRecord has the same fields)."""

MIGRATIONS: list[tuple[int, str, dict[str, list[str]]]] = [
    (1, "usage_records", {
        "sqlite": ["""CREATE TABLE usage_records (
            request_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL,
            tier TEXT NOT NULL, model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL, status INTEGER NOT NULL, error_code TEXT NOT NULL, ttft_s REAL,
            latency_s REAL NOT NULL, shard TEXT NOT NULL, degradation_level INTEGER NOT NULL,
            session INTEGER NOT NULL, gateway TEXT NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL)"""],
        "postgresql": ["""CREATE TABLE usage_records (
            request_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL,
            tier TEXT NOT NULL, model TEXT NOT NULL, prompt_tokens BIGINT NOT NULL, cached_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL, status INTEGER NOT NULL, error_code TEXT NOT NULL,
            ttft_s DOUBLE PRECISION, latency_s DOUBLE PRECISION NOT NULL, shard TEXT NOT NULL,
            degradation_level INTEGER NOT NULL, session BOOLEAN NOT NULL, gateway TEXT NOT NULL,
            started_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL)"""],
    }),
    (2, "indexes for the usage queries", {
        "sqlite": ["CREATE INDEX usage_started ON usage_records (started_at)",
                   "CREATE INDEX usage_tenant_started ON usage_records (tenant, started_at)",
                   "CREATE INDEX usage_key_started ON usage_records (key_id, started_at)"],
        "postgresql": ["CREATE INDEX usage_started ON usage_records (started_at)",
                       "CREATE INDEX usage_tenant_started ON usage_records (tenant, started_at)",
                       "CREATE INDEX usage_key_started ON usage_records (key_id, started_at)"],
    }),
    (3, "structured outputs and tool calls", {
        "sqlite": ["ALTER TABLE usage_records ADD COLUMN output_kind TEXT NOT NULL DEFAULT 'text'",
                   "ALTER TABLE usage_records ADD COLUMN tool_calls INTEGER NOT NULL DEFAULT 0"],
        "postgresql": ["ALTER TABLE usage_records ADD COLUMN output_kind TEXT NOT NULL DEFAULT 'text'",
                       "ALTER TABLE usage_records ADD COLUMN tool_calls INTEGER NOT NULL DEFAULT 0"],
    }),
]
"""(version, what, statements per dialect): append only."""

MIGRATION_LOCK_ID = 0x5B1ED6E2
"""PostgreSQL advisory lock held while migrating (any constant unique to this schema)."""
GROUP_FIELDS = ("tenant", "tier", "model", "key_id")
"""What a usage query may group by besides the time bucket."""


@dataclass(frozen=True)
class UsageQuery:
    """Filters and grouping of a usage read. Times are unix seconds, [start, end)."""

    start: float | None = None
    end: float | None = None
    tenant: str | None = None
    key_id: str | None = None
    tier: str | None = None
    model: str | None = None
    models: tuple[str, ...] = ()
    """Only these models (any of them); () = every model."""
    model_requests_only: bool = False
    """Only requests a model answered (a shard's stream, or the response cache's replay, opened) and the server
    did not fail (status < 500): what OpenAI's usage API counts as `num_model_requests`. Requests refused before
    any model (a 400, a 429) and server failures (billed nothing) stay out."""
    bucket_s: int | None = None
    """Bucket width in seconds (3600 = hour, 86400 = day, UTC-aligned); None: one bucket for the range."""
    group_by: tuple[str, ...] = ()
    """Any of GROUP_FIELDS."""
    limit: int = 10000
    """Most rows returned: the newest buckets, whole (a bucket the limit would cut is left out), and the result
    says `truncated` (the totals still cover the whole range)."""


SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens")


@dataclass(frozen=True)
class KeyActivity:
    """One key's requests with one error code ("" = answered) over a time range (`activity`)."""

    key_id: str
    tenant: str
    error_code: str
    requests: int
    tokens: int
    first_at: float | None = None
    """When the first of these requests started (unix s); None: not known (taken as the range's start)."""


class LedgerStore(Protocol):
    """What the ledger's writer and readers need of a database."""

    url: str

    def migrate(self) -> int: ...

    def insert_many(self, rows: list[tuple[Any, ...]]) -> int: ...

    def usage(self, query: UsageQuery) -> dict[str, Any]: ...

    def prune(self, before: float) -> int: ...

    def activity(self, start: float, end: float) -> list[KeyActivity]: ...

    def close(self) -> None: ...


def table_missing(exc: BaseException) -> bool:
    """`exc` says the ledger's table is not there yet (SQLite's "no such table", PostgreSQL's SQLSTATE 42P01):
    a reader (the control plane) before the first gateway migrated the database."""
    if isinstance(exc, sqlite3.OperationalError):
        return "no such table" in str(exc)
    return getattr(exc, "sqlstate", None) == "42P01" or getattr(exc, "pgcode", None) == "42P01"


class _SqlStore:
    """The dialect-independent part: migrations, idempotent inserts, grouped reads, retention."""

    dialect = ""
    placeholder = "?"

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: Any = None
        self._lock = threading.Lock()  # one statement at a time per connection (readers may share)

    # -- connection -----------------------------------------------------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _conn_or_open(self) -> Any:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _run(self, fn: Any) -> Any:
        """fn(conn) in a transaction; on any error the connection is dropped (reopened next time)."""
        with self._lock:
            conn = self._conn_or_open()
            try:
                out = fn(conn)
                conn.commit()
                return out
            except BaseException:
                try:
                    conn.rollback()
                    conn.close()
                except Exception:  # noqa: BLE001, S110 -- the connection is gone anyway
                    pass
                self._conn = None
                raise

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- schema ---------------------------------------------------------------------------------

    def _lock_for_migration(self, cur: Any) -> None:
        pass

    def migrate(self) -> int:
        """Apply the migrations this database lacks; returns the schema version now in force."""
        def run(conn: Any) -> int:
            cur = conn.cursor()
            self._lock_for_migration(cur)
            cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                        "description TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)")
            cur.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version")
            current = int(cur.fetchone()[0])
            for version, description, statements in MIGRATIONS:
                if version <= current:
                    continue
                for sql in statements[self.dialect]:
                    cur.execute(sql)
                cur.execute(self._sql("INSERT INTO schema_version (version, description, applied_at) "
                                      "VALUES (%s, %s, %s)"), (version, description, time.time()))
                current = version
            return current

        return int(self._run(run))

    def _sql(self, text: str) -> str:
        return text.replace("%s", self.placeholder)

    # -- writes ---------------------------------------------------------------------------------

    def insert_many(self, rows: list[tuple[Any, ...]]) -> int:
        """Insert records, skipping request ids already stored (a replayed spool); returns how many
        were new."""
        if not rows:
            return 0
        marks = ", ".join(["%s"] * len(COLUMNS))
        sql = self._sql(f"INSERT INTO usage_records ({', '.join(COLUMNS)}) VALUES ({marks}) "
                        "ON CONFLICT (request_id) DO NOTHING")

        def run(conn: Any) -> int:
            cur = conn.cursor()
            cur.executemany(sql, [self._adapt(r) for r in rows])
            return max(0, int(cur.rowcount or 0))  # both drivers sum executemany's rows; skipped ones are 0

        return int(self._run(run))

    def _adapt(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        return row

    def prune(self, before: float) -> int:
        """Delete records that started before `before` (retention); returns how many went."""
        def run(conn: Any) -> int:
            cur = conn.cursor()
            cur.execute(self._sql("DELETE FROM usage_records WHERE started_at < %s"), (before,))
            return int(cur.rowcount or 0)

        return int(self._run(run))

    # -- reads ----------------------------------------------------------------------------------

    def usage(self, query: UsageQuery) -> dict[str, Any]:
        """{"rows": [{"start", "end", <group fields>, requests, errors, *_tokens}], "totals": {...},
        "truncated": bool} with rows oldest first."""
        for name in query.group_by:
            if name not in GROUP_FIELDS:
                raise ValueError(f"cannot group by {name!r}; choose from {', '.join(GROUP_FIELDS)}")
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("tenant", query.tenant), ("key_id", query.key_id), ("tier", query.tier),
                              ("model", query.model)):
            if value is not None:
                where.append(f"{column} = %s")
                params.append(value)
        if query.models:
            where.append(f"model IN ({', '.join(['%s'] * len(query.models))})")
            params.extend(query.models)
        if query.model_requests_only:
            where.append("shard <> '' AND status < 500")
        if query.start is not None:
            where.append("started_at >= %s")
            params.append(query.start)
        if query.end is not None:
            where.append("started_at < %s")
            params.append(query.end)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        sums = ("COUNT(*), SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), SUM(prompt_tokens), "
                "SUM(cached_tokens), SUM(completion_tokens)")
        width = int(query.bucket_s) if query.bucket_s else 0
        bucket = f"(CAST(FLOOR(started_at / {width}) AS BIGINT) * {width})" if width else "MIN(started_at)"
        keys = list(query.group_by)
        group = ([bucket] if width else []) + keys
        select = f"SELECT {bucket}, MAX(started_at), {', '.join(keys) + ', ' if keys else ''}{sums} FROM usage_records"
        sql = select + clause + (f" GROUP BY {', '.join(group)}" if group else "")
        sql += (f" ORDER BY 1 DESC LIMIT {int(query.limit) + 1}" if group else "")  # one more: was it cut?

        def run(conn: Any) -> tuple[list[Any], list[Any]]:
            cur = conn.cursor()
            cur.execute(self._sql(sql), params)
            rows = cur.fetchall()
            cur.execute(self._sql(f"SELECT MIN(started_at), MAX(started_at), {sums} FROM usage_records" + clause),
                        params)
            return rows, cur.fetchone()

        try:
            rows, total = self._run(run)
        except Exception as exc:
            if not table_missing(exc):
                raise
            rows, total = [], (None, None, *([0] * len(SUMS)))  # not migrated yet: nothing recorded
        truncated = len(rows) > query.limit
        if truncated:  # the oldest bucket kept may have lost some of its groups to the limit: all of it goes
            cut = rows[query.limit][0]
            rows = [r for r in rows[:query.limit] if r[0] != cut]
        out = []
        for row in reversed(rows):
            if row[0] is None:
                continue
            start = float(row[0])
            item: dict[str, Any] = {"start": start, "end": start + width if width else float(row[1])}
            item.update(zip(keys, row[2:2 + len(keys)]))
            item.update(zip(SUMS, (int(v or 0) for v in row[2 + len(keys):])))
            out.append(item)
        totals = dict(zip(SUMS, (int(v or 0) for v in total[2:])))
        return {"rows": out, "totals": totals, "truncated": truncated}

    def activity(self, start: float, end: float) -> list[KeyActivity]:
        """Per key and error code, the requests and tokens started in [start, end): what the abuse
        monitor (control_plane/abuse/) compares with each key's baseline. Keys only (no text)."""
        sql = ("SELECT key_id, tenant, error_code, COUNT(*), SUM(prompt_tokens + completion_tokens), MIN(started_at) "
               "FROM usage_records WHERE started_at >= %s AND started_at < %s AND key_id <> '' "
               "GROUP BY key_id, tenant, error_code")

        def run(conn: Any) -> list[Any]:
            cur = conn.cursor()
            cur.execute(self._sql(sql), [start, end])
            return list(cur.fetchall())

        try:
            rows = self._run(run)
        except Exception as exc:
            if not table_missing(exc):
                raise
            rows = []  # no gateway has written (migrated) the ledger yet: no activity, not an error
        return [KeyActivity(str(k), str(t), str(c), int(n or 0), int(tok or 0), None if first is None else float(first))
                for k, t, c, n, tok, first in rows]


class SqliteStore(_SqlStore):
    """The embedded default: one file, WAL (readers never block the writer), busy timeout for
    several gateways sharing it on one machine."""

    dialect = "sqlite"
    placeholder = "?"

    def __init__(self, url: str, path: Path) -> None:
        super().__init__(url)
        self.path = path

    def _connect(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False, isolation_level="DEFERRED")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _lock_for_migration(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")  # one migrator at a time across processes


class PostgresStore(_SqlStore):
    """PostgreSQL through psycopg 3: what several gateways share."""

    dialect = "postgresql"
    placeholder = "%s"

    def _connect(self) -> Any:
        import psycopg  # only this store needs the driver

        return psycopg.connect(self.url, connect_timeout=5, application_name="switchboard-ledger")

    def _lock_for_migration(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_ID,))

    def _adapt(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(row)
        out[COLUMNS.index("session")] = bool(out[COLUMNS.index("session")])
        return tuple(out)


def open_ledger_store(url: str) -> LedgerStore:
    """`postgresql://…` (or `postgres://…`) -> PostgresStore; `sqlite:///path` or a path -> SqliteStore."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStore(url)
    # SQLAlchemy's spelling: sqlite:///relative/path, sqlite:////absolute/path
    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url
    return SqliteStore(url, Path(path))


def check_usage_db(url: str | None) -> str | None:
    """`url` if :func:`open_ledger_store` reads it as meant (settings' validator): a URL of another scheme
    (``bogus://``, ``mysql://``, ``sqlite://x`` with two slashes) was taken for a relative file path, and
    every process wrote a SQLite file named after it in its working folder."""
    if url is None or url == "off" or "://" not in url:
        return url
    if url.startswith(("postgresql://", "postgres://", "sqlite:///")):
        return url
    raise ValueError(f"unsupported database URL {url.split('://', 1)[0]}://...: give sqlite:///PATH, "
                     "postgresql://USER@HOST/DB, a file path, or off")


def default_usage_db(state_dir: str | Path) -> str:
    """The embedded default: a SQLite file in the state dir (the control plane reads the same URL)."""
    return f"sqlite:///{Path(state_dir) / 'usage.db'}"
