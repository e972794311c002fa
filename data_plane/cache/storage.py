"""Where a cache node keeps transcripts: in process memory (bytes bounded, fair between owners, TTL) or in Redis.

Built and owned by the cache node (data_plane/cache/node.py) from its storage settings; nothing
else reads or writes it.

    storage = MemoryStorage(max_bytes=256 << 20, on_evict=metrics.evicted)   # or, kept across restarts,
    storage = MemoryStorage(256 << 20, snapshot=Snapshot(Path("cache-0.jsonl")))  # or
    storage = RedisStorage("redis://127.0.0.1:6379/0", prefix="switchboard:cache-0:session:")
    await storage.start()
    outcome = await storage.put(transcript, ttl_s=3600)   # PutOutcome(stored, version)
    transcript = await storage.get("sess_...")

Both keep whole records, the newer version winning (a put older than what is stored is refused
and says which version is stored; with ``only_newer``, a turn's write, one of the same version too: another
gateway's turn got there first); the HTTP API over them is data_plane/cache/node.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from data_plane.cache.model import Transcript
from data_plane.cache.snapshot import Snapshot
from data_plane.common.errors import (
    Overloaded,
    PayloadTooLarge,
)
from data_plane.common.tasks import stop_tasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PutOutcome:
    stored: bool
    version: int
    """The version now stored (the caller's when stored, the newer one when not)."""


@dataclass(frozen=True)
class StorageStats:
    entries: int
    bytes: int


class Storage(Protocol):
    """What the HTTP handlers need; called once per request, on the event loop."""

    async def get(self, session_id: str) -> Transcript | None: ...
    async def put(self, record: Transcript, ttl_s: float, *, only_newer: bool = False) -> PutOutcome: ...
    async def delete(self, session_id: str, *, if_version: int | None = None) -> bool: ...


class ManagedStorage(Storage, Protocol):
    """A backend with a lifecycle: ``start`` in the lifespan, ``stats`` per scrape, ``ready`` per /health."""

    backend: str

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def ready(self) -> bool: ...
    def stats(self) -> StorageStats: ...


def encode_record(record: Transcript) -> bytes:
    return json.dumps(record.to_wire(), separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@dataclass
class _Owner:
    """One owner's records in the memory store (an API key's, or a tenant's stored chat completions)."""

    bytes: int = 0
    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Its records' ids, least recently used first."""


@dataclass
class _Entry:
    record: Transcript
    size: int
    expires_at: float


class MemoryStorage:
    """Records in an OrderedDict kept in LRU order, bounded by `max_bytes` and expired by TTL.

    Past `max_bytes`, the least recently used record *of the owner holding the most bytes* goes (max-min
    fairness between owners: the record's ``owner``, an API key's digest or a tenant's). A global LRU let
    one key push every other tenant's records out: one free key storing ~1.1 MB per request (a chat
    completion with `store: true`, or a Responses turn, whose messages beyond the context window cost it
    ~40 tokens) at its 60 requests a minute replaced the default 256 MiB within about four minutes. Now
    such a key, once it holds the most, evicts its own records; an owner below it loses none.

    Expired records vanish on read and from a sweeper task (``cache-node-ttl-sweeper``) that
    pops a heap of expiry times; `on_evict(reason, count)` hears of every eviction, `on_snapshot(ok)`
    of every snapshot write (a full or read-only disk: the node keeps serving from memory, and says so).

    With a `snapshot`, ``start`` loads the records it holds and a task (``cache-node-snapshot``)
    rewrites it every `snapshot_interval_s` when a record was stored or deleted since, and ``aclose``
    once more: a clean restart loses nothing, a crash what changed in the last interval.
    """

    backend = "memory"

    def __init__(
        self,
        max_bytes: int,
        *,
        on_evict: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 0.5,
        snapshot: Snapshot | None = None,
        snapshot_interval_s: float = 10.0,
        on_snapshot: Callable[[bool], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._on_evict = on_evict or (lambda reason, n: None)
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._owners: dict[str, _Owner] = {}
        self._largest: list[tuple[int, str]] = []
        """A max-heap of (-bytes, owner), pushed at every change of an owner's bytes; entries that no longer
        match the owner's bytes are dropped when met (`_evictee`) or by a rebuild (`_rank`)."""
        self._expiries: list[tuple[float, str]] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._snapshot = snapshot
        self._snapshot_interval_s = snapshot_interval_s
        self._snapshotter: asyncio.Task[None] | None = None
        self._writing: asyncio.Future[int] | None = None
        self._changed = False
        self._on_snapshot = on_snapshot or (lambda ok: None)
        self._snapshot_failing = False

    async def start(self) -> None:
        if self._snapshot is not None:
            restored = await asyncio.to_thread(self._snapshot.read, self._clock())
            for record, expires_at in restored:
                if record.session_id in self._entries:  # a file written by hand, or twice over
                    self._remove(record.session_id)
                self._insert(record, len(encode_record(record)), expires_at)
            log.info("restored %d of %d records from %s", len(self._entries), len(restored), self._snapshot.path)
            self._snapshotter = asyncio.create_task(self._snapshot_loop(), name="cache-node-snapshot")
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="cache-node-ttl-sweeper")

    async def aclose(self) -> None:
        await stop_tasks(self._sweeper, self._snapshotter)
        self._sweeper = self._snapshotter = None
        if self._writing is not None:  # a periodic write cut off by the stop: let it finish before the last
            with contextlib.suppress(OSError):
                await self._writing
        await self.save(force=True)

    async def save(self, *, force: bool = False) -> None:
        """Write the snapshot (when there is one, and a record changed since the last write or `force`).
        The entries are listed here, on the event loop; the file is written in a thread."""
        if self._snapshot is None or not (self._changed or force):
            return
        self._changed = False
        entries = [(e.record, e.expires_at) for e in self._entries.values()]
        self._writing = asyncio.ensure_future(asyncio.to_thread(self._snapshot.write, entries))
        try:
            await asyncio.shield(self._writing)  # a stop waits for it in aclose rather than racing it
        except OSError as exc:
            self._changed = True
            self._snapshot_failing = True
            self._on_snapshot(False)
            log.warning("cache snapshot %s not written: %s; the records are served from memory, and a restart "
                        "would lose what changed since the last write", self._snapshot.path, exc)
            return
        self._on_snapshot(True)
        if self._snapshot_failing:
            self._snapshot_failing = False
            log.warning("cache snapshot %s written again", self._snapshot.path)

    async def ready(self) -> bool:
        return True

    def stats(self) -> StorageStats:
        return StorageStats(len(self._entries), self._bytes)

    async def get(self, session_id: str) -> Transcript | None:
        entry = self._live(session_id)
        if entry is None:
            return None
        self._entries.move_to_end(session_id)
        self._owners[entry.record.owner].ids.move_to_end(session_id)
        return entry.record

    async def put(self, record: Transcript, ttl_s: float, *, only_newer: bool = False) -> PutOutcome:
        current = self._live(record.session_id)
        if current is not None and current.record.version >= record.version + (0 if only_newer else 1):
            return PutOutcome(False, current.record.version)
        size = len(encode_record(record))
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"record of {size} bytes exceeds this node's capacity of {self.max_bytes}",
                code="record_too_large",
            )
        if current is not None:
            self._remove(record.session_id)
        self._insert(record, size, self._clock() + ttl_s)
        self._changed = True
        return PutOutcome(True, record.version)

    async def delete(self, session_id: str, *, if_version: int | None = None) -> bool:
        """Remove the record (`if_version`: only while it is that version); whether one was removed."""
        entry = self._live(session_id)
        if entry is None or (if_version is not None and entry.record.version != if_version):
            return False
        self._remove(session_id)
        self._changed = True
        return True

    def _insert(self, record: Transcript, size: int, expires_at: float) -> None:
        """Keep `record` as the most recently used, evicting past `max_bytes` the least recent records of
        the owner that holds the most (see the class docstring)."""
        self._entries[record.session_id] = _Entry(record, size, expires_at)
        self._bytes += size
        owner = self._owners.setdefault(record.owner, _Owner())
        owner.ids[record.session_id] = None
        owner.bytes += size
        self._rank(record.owner, owner)
        heapq.heappush(self._expiries, (expires_at, record.session_id))
        evicted = 0
        while self._bytes > self.max_bytes:
            self._remove(self._evictee(keep=record.session_id))
            evicted += 1
        if evicted:
            self._on_evict("lru", evicted)

    def _rank(self, name: str, owner: _Owner) -> None:
        heapq.heappush(self._largest, (-owner.bytes, name))
        if len(self._largest) > 2 * len(self._owners) + 1024:  # superseded entries linger
            self._largest = [(-o.bytes, n) for n, o in self._owners.items()]
            heapq.heapify(self._largest)

    def _evictee(self, keep: str) -> str:
        """The least recently used record of the owner holding the most bytes, never `keep` (the record being
        stored: an owner whose one record it is may hold the most, and the write must not answer stored for a
        record already gone; the next largest owner makes the room, as put() refuses a record past max_bytes)."""
        skipped: tuple[int, str] | None = None
        try:
            while self._largest:
                held, name = self._largest[0]
                owner = self._owners.get(name)
                if owner is None or owner.bytes != -held:
                    heapq.heappop(self._largest)
                    continue
                oldest = next(iter(owner.ids))
                if oldest != keep:
                    return oldest
                skipped = heapq.heappop(self._largest)  # `keep` is its owner's only record
            return keep  # alone and past max_bytes: a snapshot restored under a lower --max-bytes
        finally:
            if skipped is not None:
                heapq.heappush(self._largest, skipped)

    def sweep(self) -> int:
        """Drop every expired record now; returns how many."""
        now, dropped = self._clock(), 0
        while self._expiries and self._expiries[0][0] <= now:
            _, session_id = heapq.heappop(self._expiries)
            entry = self._entries.get(session_id)
            if entry is not None and entry.expires_at <= now:
                self._remove(session_id)
                dropped += 1
        if len(self._expiries) > 2 * len(self._entries) + 1024:  # overwritten records linger
            self._expiries = [(e.expires_at, sid) for sid, e in self._entries.items()]
            heapq.heapify(self._expiries)
        if dropped:
            self._on_evict("ttl", dropped)
        return dropped

    def _live(self, session_id: str) -> _Entry | None:
        entry = self._entries.get(session_id)
        if entry is not None and entry.expires_at <= self._clock():
            self._remove(session_id)
            self._on_evict("ttl", 1)
            return None
        return entry

    def _remove(self, session_id: str) -> None:
        entry = self._entries.pop(session_id)
        self._bytes -= entry.size
        name = entry.record.owner
        owner = self._owners[name]
        del owner.ids[session_id]
        owner.bytes -= entry.size
        if owner.ids:
            self._rank(name, owner)
        else:
            del self._owners[name]

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            self.sweep()

    async def _snapshot_loop(self) -> None:
        """Every `snapshot_interval_s`, and never more than 1/20 of the time: a write rewrites the whole
        store (measured: 256 MiB of 8 KiB records, 2.7 s wall and 1.1 s of CPU), so the next one waits 20x
        the last one's wall time when that is longer than the interval."""
        while True:
            t0 = time.monotonic()
            await self.save()
            await asyncio.sleep(max(self._snapshot_interval_s, 20 * (time.monotonic() - t0)))


# Compare-and-set by version, atomically: keep the stored record when it is newer (ARGV[4] 1), or
# not older (ARGV[4] 0: only_newer, a turn's write).
_PUT_IF_NOT_OLDER = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' and tonumber(rec['version']) ~= nil
     and tonumber(rec['version']) >= tonumber(ARGV[2]) + tonumber(ARGV[4]) then
    return {0, tostring(rec['version'])}
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return {1, ARGV[2]}
"""

# Remove the record only while it holds version ARGV[1] (a copy moved back to its home node; a write since stays).
_DELETE_IF_VERSION = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local ok, rec = pcall(cjson.decode, cur)
if ok and type(rec) == 'table' and tonumber(rec['version']) == tonumber(ARGV[1]) then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


READY_TIMEOUT_S = 0.5
"""Seconds a Redis-backed node's `/health` waits for Redis's PING before it answers 503. Its client waits
up to 2 s (socket_timeout) for a command, so a stalled Redis (a partition that drops packets, a long
fork) made `/health` take 2 s: past `switchboard up`'s liveness probe (1 s, control_plane/supervisor.py),
which after 30 s SIGKILLed every cache node as hung though each was up and saying why."""


class RedisStorage:
    """One Redis string per session (JSON, expiring with PX); Redis does TTL and memory eviction.

    Entry and byte gauges come from a SCAN of this node's prefix every `stats_interval_s`
    (task ``cache-node-redis-stats``); evictions happen inside Redis and are not counted here.
    Redis failures surface as 503 ``cache_backend_unavailable``.
    """

    backend = "redis"

    def __init__(self, url: str, prefix: str, *, stats_interval_s: float = 10.0) -> None:
        import redis.asyncio as aioredis  # only Redis-backed nodes pay for the import

        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
        self._put_script = self._redis.register_script(_PUT_IF_NOT_OLDER)
        self._delete_script = self._redis.register_script(_DELETE_IF_VERSION)
        self._prefix = prefix
        self._stats_interval_s = stats_interval_s
        self._stats = StorageStats(0, 0)
        self._stats_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._stats_task = asyncio.create_task(self._stats_loop(), name="cache-node-redis-stats")

    async def aclose(self) -> None:
        await stop_tasks(self._stats_task)
        await self._redis.aclose()

    async def ready(self) -> bool:
        """Whether Redis answers a PING within READY_TIMEOUT_S (`/health`'s answer)."""
        from redis.exceptions import RedisError

        try:
            return bool(await asyncio.wait_for(self._redis.ping(), READY_TIMEOUT_S))
        except (RedisError, OSError, TimeoutError):
            return False

    def stats(self) -> StorageStats:
        return self._stats

    async def get(self, session_id: str) -> Transcript | None:
        with _redis_errors():
            raw = await self._redis.get(self._prefix + session_id)
        return None if raw is None else Transcript.from_wire(json.loads(raw))

    async def put(self, record: Transcript, ttl_s: float, *, only_newer: bool = False) -> PutOutcome:
        px = max(1, int(ttl_s * 1000))
        with _redis_errors():
            stored, version = await self._put_script(
                keys=[self._prefix + record.session_id],
                args=[encode_record(record), record.version, px, 0 if only_newer else 1]
            )
        return PutOutcome(bool(int(stored)), int(version))

    async def delete(self, session_id: str, *, if_version: int | None = None) -> bool:
        with _redis_errors():
            if if_version is None:
                return bool(await self._redis.delete(self._prefix + session_id))
            return bool(await self._delete_script(keys=[self._prefix + session_id], args=[if_version]))

    async def refresh_stats(self) -> StorageStats:
        entries = size = 0
        async for keys in self._scan_batches():
            entries += len(keys)
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.strlen(key)
                size += sum(await pipe.execute())
        self._stats = StorageStats(entries, size)
        return self._stats

    async def _scan_batches(self) -> AsyncIterator[list[bytes | str]]:
        cursor = 0
        while True:
            cursor, keys = await self._redis.scan(cursor, match=self._prefix + "*", count=1000)
            if keys:
                yield keys
            if cursor == 0:
                return

    async def _stats_loop(self) -> None:
        while True:
            try:
                await self.refresh_stats()
            except Exception as exc:  # noqa: BLE001 - stats are advisory; never kill the loop
                log.debug("redis stats refresh failed: %s", type(exc).__name__)
            await asyncio.sleep(self._stats_interval_s)


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    """The one place Redis' exceptions become ours."""
    from redis.exceptions import RedisError

    try:
        yield
    except (RedisError, OSError) as exc:
        log.warning("redis backend failed: %s", type(exc).__name__)
        raise Overloaded(
            "cache backend unavailable", code="cache_backend_unavailable", retry_after=1
        ) from None


