"""The usage ledger: one record per chat request, spooled before the reply completes and written to
the database (data_plane/ledger/store.py) off the hot path, in batches.

    ledger = UsageLedger(open_ledger_store(url), Spool(Path(".switchboard/ledger-spool/gw-0")),
                         LedgerMetrics(registry), gateway="gw-0")
    await ledger.start()                  # replays what a previous run left in the spool
    ledger.record(UsageRecord(...))       # on the request path: one os.write of one JSON line
    await ledger.flush()                  # what the background task does every --usage-flush-interval
    await ledger.aclose()                 # last flush; the task `ledger-flush` is stopped

Delivery is at-least-once with idempotent request ids. `record` appends the record to the spool
(a segment file, one JSON line, one `write` syscall: ~10 µs, no fsync) *before* the response's last
byte is sent, so a reply the client saw complete has its record in the kernel's page cache: a gateway
killed with -9 loses none (a power cut may lose the last seconds: that would need an fsync per
request). The flusher closes the current segment, inserts its records in one transaction with
`ON CONFLICT (request_id) DO NOTHING`, then deletes the file; a crash between the insert and the
delete replays the segment at the next start, and the duplicates are skipped. A database that is
down only grows the spool (`switchboard_ledger_spool_records`); writes retry with backoff.
A spool that refuses a record (a full or read-only disk) loses nothing either: the record is held in
memory (`switchboard_ledger_held_records`, at most `held_max`, oldest dropped beyond, counted `dropped`),
put back in the spool at the next flush once the disk takes it, or written straight to the database
when the database lives elsewhere; a write cut short leaves no torn line in the segment.
No prompt or completion text is part of a record.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.common.outcome import OK, Outcome
from data_plane.common.tasks import stop_tasks
from data_plane.ledger.store import COLUMNS, LedgerStore, UsageQuery

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
HELD_MAX = 100_000
"""Records held in memory while the spool's disk refuses them (~300 bytes each: ~30 MB at most)."""
PRUNE_INTERVAL_S = 3600.0


@dataclass(frozen=True)
class UsageRecord:
    """One request's usage and outcome (no text). Times are unix seconds; durations seconds."""

    request_id: str
    trace_id: str
    key_id: str
    """The key's short SHA-256 digest (data_plane/gateway/auth.py Principal.key_id); "" when unauthenticated."""
    tenant: str
    tier: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: int
    error_code: str
    """"" on success; the OpenAI error code (or client_disconnected) otherwise."""
    ttft_s: float | None
    latency_s: float
    shard: str
    degradation_level: int
    session: bool
    gateway: str
    started_at: float
    finished_at: float
    output_kind: str = "text"
    """What the output followed: text, json_object, json_schema, regex, choice, grammar or tools."""
    tool_calls: int = 0
    """Tool calls in the reply."""

    def as_row(self) -> tuple[Any, ...]:
        return astuple(self)


assert tuple(f.name for f in fields(UsageRecord)) == COLUMNS, "UsageRecord and ledger_sql.COLUMNS disagree"


def record_for(outcome: Outcome, gateway: str) -> UsageRecord:
    """The record of one request's Outcome (built by the gateway's Exchange as the request ended)."""
    now = time.time()
    o = outcome
    return UsageRecord(
        request_id=o.request_id, trace_id=o.trace_id, key_id=o.key_id, tenant=o.tenant, tier=o.tier, model=o.model,
        prompt_tokens=o.prompt_tokens, cached_tokens=o.cached_tokens, completion_tokens=o.completion_tokens,
        status=o.status, error_code="" if o.code == OK else o.code, ttft_s=o.ttft_s, latency_s=o.latency_s,
        shard=o.shard, degradation_level=o.degradation_level, session=o.session, gateway=gateway,
        started_at=round(now - o.latency_s, 6), finished_at=round(now, 6), output_kind=o.output_kind,
        tool_calls=o.tool_calls)


class LedgerMetrics:
    """The ledger's metrics (docs/metrics.md)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter("switchboard_ledger_records_total",
                               "Usage records by outcome: spooled (on the request path), written (new in the "
                               "database), duplicate (already there: a replayed spool), spool_error (the spool's "
                               "disk refused it: held in memory), dropped (lost: the memory hold was full).",
                               ["outcome"], registry=registry)
        self.write_failures = Counter("switchboard_ledger_write_failures_total",
                                      "Batch writes to the usage database that failed (retried later).",
                                      registry=registry)
        self.spool_records = Gauge("switchboard_ledger_spool_records",
                                   "Usage records spooled on local disk and not yet in the database.",
                                   registry=registry)
        self.held_records = Gauge("switchboard_ledger_held_records",
                                  "Usage records held in memory because the spool's disk refused them (full, "
                                  "read-only); lost if the gateway dies before the disk or database takes them.",
                                  registry=registry)
        self.batch = Histogram("switchboard_ledger_write_seconds", "Time to write one batch to the usage database.",
                               buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
                               registry=registry)
        for outcome in ("spooled", "written", "duplicate", "spool_error", "dropped"):
            self.records.labels(outcome)


class Spool:
    """Append-only segment files (`<ns>-<pid>.jsonl`) in one directory, owned by one process
    (an flock on `lock`; a second gateway pointed at the same directory refuses to start)."""

    def __init__(self, folder: Path, *, remove_when_empty: bool = False, target: str = "") -> None:
        """`remove_when_empty`: a folder of its own (auto-named), removed on close if nothing is left.
        `target`: which database the records are for (a digest of its URL), so only spools bound for
        the same database are adopted."""
        self.folder = folder
        self.remove_when_empty = remove_when_empty
        self.target = target
        folder.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SystemExit(f"usage spool {folder} is in use by another process; give each gateway its own "
                             "--usage-spool-dir") from None
        self._fd: int | None = None
        self._path: Path | None = None
        self._count = 0
        (folder / "target").write_text(target)

    def adopt_orphans(self) -> int:
        """Move into this spool the segments of sibling spools no live process holds (a gateway
        killed with -9 and restarted gets a new folder); returns how many segments moved."""
        moved = 0
        for other in sorted(self.folder.parent.iterdir()):
            if other == self.folder or not other.is_dir():
                continue
            try:
                fd = os.open(other / "lock", os.O_RDWR)  # no lock file: not a spool
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _read(other / "target") != self.target:
                    continue  # bound for another database: left for a gateway that writes there
                for segment in sorted(other.glob("*.jsonl")):
                    segment.rename(self.folder / segment.name)
                    moved += 1
                for name in ("lock", "target"):
                    (other / name).unlink(missing_ok=True)
                other.rmdir()
            except OSError:  # held by a live gateway, or another one adopted it first
                pass
            finally:
                os.close(fd)
        return moved

    def segments(self) -> list[Path]:
        """Closed segments (and any a previous process left), oldest first."""
        return sorted(p for p in self.folder.glob("*.jsonl") if p != self._path)

    def append(self, line: bytes) -> None:
        """One record, one write: complete in the page cache when this returns, or OSError and nothing
        written (a write a full disk cut short is taken back: a torn line would also take the next
        record with it, as the two would read as one bad line)."""
        if self._fd is None:
            self._path = self.folder / f"{time.time_ns():020d}-{os.getpid()}.jsonl"
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        written = os.write(self._fd, line)
        if written < len(line):
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
            raise OSError(errno.ENOSPC, f"short write to the usage spool ({written} of {len(line)} bytes)")
        self._count += 1

    def rotate(self) -> Path | None:
        """Close the segment being written (the next append starts a new one); None if empty."""
        if self._fd is None:
            return None
        os.close(self._fd)
        path, self._fd, self._path, self._count = self._path, None, None, 0
        return path

    def close(self) -> None:
        self.rotate()
        if self.remove_when_empty and not self.segments():
            with contextlib.suppress(OSError):
                for name in ("lock", "target"):
                    (self.folder / name).unlink(missing_ok=True)
                self.folder.rmdir()
        os.close(self._lock_fd)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


SPOOL_DEFAULTS = {"output_kind": "text", "tool_calls": 0}
"""Columns added after a spool was written (an older gateway's records): their defaults."""


def _row(item: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(item[c] if c in item else SPOOL_DEFAULTS[c] for c in COLUMNS)


def read_segment(path: Path) -> list[tuple[Any, ...]]:
    """The records of a segment as rows; a torn last line (a crash mid-write) is skipped."""
    rows = []
    with open(path, "rb") as f:
        for line in f:
            try:
                rows.append(_row(json.loads(line)))
            except (ValueError, KeyError):
                log.warning("usage spool %s: skipping an unreadable line", path.name)
    return rows


class UsageLedger:
    """Spools records on the request path; a background task (`ledger-flush`) writes them."""

    def __init__(self, store: LedgerStore, spool: Spool, metrics: LedgerMetrics, *, gateway: str,
                 flush_interval_s: float = 1.0, retention_days: float = 0.0, held_max: int = HELD_MAX) -> None:
        self.store = store
        self.spool = spool
        self.metrics = metrics
        self.gateway = gateway
        self.flush_interval_s = flush_interval_s
        self.retention_days = retention_days
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one flush at a time (the task's and an explicit one)
        self._failures = 0
        self._retry_at = 0.0
        self._pruned_at: float | None = None  # first prune right after the first successful flush
        self._pending = 0
        self._migrated = False
        self._held: deque[bytes] = deque()  # records the spool refused, oldest first
        self._held_max = held_max
        self._writing = 0  # held records being written straight to the database now (`_release_held`)

    async def start(self) -> None:
        """Count what a previous run left in the spool, and start the flusher (which migrates the
        database on its first write, retrying while it is unreachable)."""
        left = await self._in_thread(lambda: sum(len(read_segment(p)) for p in self.spool.segments()))
        if left:
            log.info("usage ledger: %d records left in the spool by a previous run; replaying", left)
        self._pending = left
        self.metrics.spool_records.set(left)
        self._task = asyncio.create_task(self._run(), name="ledger-flush")

    def record_request(self, outcome: Outcome) -> None:
        """Spool the record of a request's Outcome (never raises)."""
        self.record(record_for(outcome, self.gateway))

    def record(self, rec: UsageRecord) -> None:
        """Spool one record (never raises: a failure holds it in memory, logged once and counted)."""
        line = json.dumps(rec.__dict__, separators=(",", ":")).encode() + b"\n"
        try:
            if self._held or self._writing:  # the disk refused the last one: the flusher retries it, not every request
                raise OSError(errno.ENOSPC, "the spool refused an earlier record")
            self._spool(line)
        except Exception as exc:  # noqa: BLE001 -- the request path never fails for its record
            self._hold(line, exc)

    def _spool(self, line: bytes) -> None:
        self.spool.append(line)
        self.metrics.records.labels("spooled").inc()
        self._pending += 1
        self.metrics.spool_records.set(self._pending)

    def _hold(self, line: bytes, exc: Exception) -> None:
        if not self._held and not self._writing:
            log.warning("usage ledger: the spool in %s refused a record (%s: %s); records are held in memory "
                        "(up to %d) until the disk or the database takes them", self.spool.folder,
                        type(exc).__name__, exc, self._held_max)
        self.metrics.records.labels("spool_error").inc()
        if len(self._held) >= self._held_max:
            self._held.popleft()
            self.metrics.records.labels("dropped").inc()
        self._held.append(line)
        self.metrics.held_records.set(len(self._held) + self._writing)

    async def _release_held(self) -> None:
        """Put held records back in the spool; what it still refuses goes straight to the database, taken out
        of the hold while that write runs (records held meanwhile wait behind them, and a full hold drops the
        oldest of those, never one being written: they were pushed out, and newer ones taken off in their place)."""
        if not self._held:
            return
        try:
            while self._held:
                self._spool(self._held[0])
                self._held.popleft()
        except OSError:
            lines = list(self._held)
            self._held.clear()
            self._writing = len(lines)
            try:
                total = await self._in_thread(lambda: self._write_rows(lines))
            except Exception:  # noqa: BLE001 -- held until the next flush, ahead of the records held meanwhile
                self._held.extendleft(reversed(lines))
                while len(self._held) > self._held_max:
                    self._held.popleft()
                    self.metrics.records.labels("dropped").inc()
                return
            finally:
                self._writing = 0
                self.metrics.held_records.set(len(self._held))
            self.metrics.records.labels("written").inc(total)
        self.metrics.held_records.set(len(self._held))
        if self._held:  # records held while the database wrote the others: the next flush
            return
        log.warning("usage ledger: the records held in memory are saved; the spool in %s takes records again",
                    self.spool.folder)

    def _write_rows(self, lines: list[bytes]) -> int:
        self._ensure_schema()
        return int(self.store.insert_many([_row(json.loads(line)) for line in lines]))

    async def _in_thread(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def flush(self) -> bool:
        """Write every spooled record now; False if the database refused (they stay spooled)."""
        async with self._lock:
            await self._release_held()
            self.spool.rotate()
            for path in self.spool.segments():
                started = time.monotonic()
                try:
                    written, total = await self._in_thread(lambda p=path: self._write_segment(p))
                except Exception as exc:  # noqa: BLE001 -- any failure to write is retried with backoff
                    self._failures += 1
                    delay = RETRY_BACKOFF_S[min(self._failures - 1, len(RETRY_BACKOFF_S) - 1)]
                    self._retry_at = time.monotonic() + delay
                    self.metrics.write_failures.inc()
                    log.warning("usage ledger: writing to %s failed (%s: %s); %d records stay spooled, retry in "
                                "%.0f s", _redact(self.store.url), type(exc).__name__, exc, self._pending, delay)
                    return False
                self.metrics.batch.observe(time.monotonic() - started)
                self._failures = 0
                self.metrics.records.labels("written").inc(written)
                self.metrics.records.labels("duplicate").inc(total - written)
                self._pending = max(0, self._pending - total)
                self.metrics.spool_records.set(self._pending)
        return True

    def _ensure_schema(self) -> None:
        """Migrate once, before the first statement of any kind (in the ledger's thread)."""
        if not self._migrated:
            version = self.store.migrate()
            self._migrated = True
            log.info("usage ledger: %s at schema version %d", _redact(self.store.url), version)

    def _write_segment(self, path: Path) -> tuple[int, int]:
        self._ensure_schema()
        rows = read_segment(path)
        written = self.store.insert_many(rows)
        path.unlink()
        return written, len(rows)

    async def usage(self, query: UsageQuery) -> dict[str, Any]:
        """A usage read (after flushing this gateway's spool, so a key sees its own last requests)."""
        await self.flush()

        def read() -> dict[str, Any]:
            self._ensure_schema()  # a new database answers "nothing yet", not "no such table"
            return dict(self.store.usage(query))

        return await self._in_thread(read)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            if time.monotonic() < self._retry_at:
                continue
            try:
                if await self.flush():
                    await self._prune()
            except Exception:  # the loop must survive anything
                log.exception("usage ledger: flush failed")

    async def _prune(self) -> None:
        if self.retention_days <= 0 or (self._pruned_at is not None
                                        and time.monotonic() - self._pruned_at < PRUNE_INTERVAL_S):
            return
        self._pruned_at = time.monotonic()
        gone = await self._in_thread(lambda: self._prune_now(time.time() - self.retention_days * 86400))
        if gone:
            log.info("usage ledger: retention removed %d records older than %g days", gone, self.retention_days)

    def _prune_now(self, before: float) -> int:
        """The schema first: a gateway that has served nothing yet has written no segment (the write
        migrates), and its first prune on a new database was a 'no such table' traceback at startup."""
        self._ensure_schema()
        return int(self.store.prune(before))

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        self._task = None
        with contextlib.suppress(Exception):
            await self.flush()
        if self._held:
            log.error("usage ledger: %d records held in memory are lost at shutdown: neither the spool in %s nor "
                      "the database took them", len(self._held), self.spool.folder)
        self.spool.close()
        await self._in_thread(self.store.close)
        self._executor.shutdown(wait=True)


def open_ledger(store: LedgerStore, registry: CollectorRegistry, *, gateway: str, state_dir: Path,
                spool_dir: Path | None = None, flush_interval_s: float = 1.0,
                retention_days: float = 0.0) -> UsageLedger:
    """The gateway's ledger: its own spool folder under `state_dir/ledger-spool/` (adopting the
    orphans of dead gateways there), unless `spool_dir` names one."""
    if spool_dir is None:
        spool = Spool(state_dir / "ledger-spool" / f"{gateway}-{os.getpid()}-{os.urandom(3).hex()}",
                      remove_when_empty=True, target=hashlib.sha256(store.url.encode()).hexdigest()[:16])
        adopted = spool.adopt_orphans()
        if adopted:
            log.info("usage ledger: adopted %d spool segments left by gateways that died", adopted)
    else:
        spool = Spool(spool_dir)
    return UsageLedger(store, spool, LedgerMetrics(registry), gateway=gateway, flush_interval_s=flush_interval_s,
                       retention_days=retention_days)


def _redact(url: str) -> str:
    """A database URL without its password, for logs."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url
