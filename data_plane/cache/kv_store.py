"""Where a cache node keeps KV blocks: in process memory (own LRU byte budget) or in Redis.

    store = MemoryKVStore(max_bytes=512 << 20, on_evict=metrics.kv_evicted)   # or RedisKVStore(url, prefix)
    await store.start()
    stored = await store.put("sess-1", frames, links=[h0, h1], ttl_s=86400)  # frames: data_plane/kv_wire.py
    frames = await store.fetch([h0, h1, h2])     # the leading run it holds, in order
    await store.drop_session("sess-1")           # the session is gone: its blocks go with it

Blocks are content-addressed (the chained block hash names the whole prefix up to it, salted per
tenant by the shard) and linked to the sessions that use them, so a block shared by two sessions
(a common system prompt) is stored once and lives while either session does. A session's links
expire with the session (``ttl_s``, the transcript's TTL, refreshed by every put) or when it is
deleted; a block no live session links is dropped. Blocks are opaque here: shards seal them before
they are sent (AES-256-GCM, data_plane/shard/kv_seal.py), so memory and Redis hold only ciphertext and
the node has no key; it never checks a checksum (the shard that uses a block does, end to end:
data_plane/kv_wire.py); it only reads each frame's claimed hash to index it. Called by data_plane/cache/kv_routes.py on the event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from data_plane.cache.storage import _redis_errors as redis_errors
from data_plane.common.tasks import stop_tasks
from data_plane.kv_wire import peek_hash

log = logging.getLogger(__name__)

EVICT_LRU = "lru"
"""Dropped to stay within the node's KV byte budget (least recently stored or fetched first)."""
EVICT_TTL = "ttl"
"""Its last session expired."""
EVICT_SESSION = "session"
"""Its last session was deleted."""


@dataclass(frozen=True)
class KVStats:
    blocks: int
    bytes: int
    sessions: int


class KVStore(Protocol):
    backend: str

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def put(self, session_id: str, frames: Sequence[bytes], links: Sequence[bytes], ttl_s: float) -> int: ...
    async def fetch(self, hashes: Sequence[bytes]) -> list[bytes]: ...
    async def drop_session(self, session_id: str) -> int: ...
    async def session_blocks(self, session_id: str) -> list[bytes]: ...
    def stats(self) -> KVStats: ...


@dataclass
class _Session:
    expires_at: float
    hashes: dict[bytes, None] = field(default_factory=dict)  # insertion (prefix) order


class MemoryKVStore:
    """Blocks in an OrderedDict in LRU order, bounded by `max_bytes`; sessions expire by TTL, or go with
    their last block: a session whose blocks the LRU took (or that linked none) is forgotten at once.
    Kept until its TTL (`--session-ttl-s`, a day by default), such a session held nothing the byte budget
    counts: once the budget was full, each new session's entry (and its expiry) stayed a day after the LRU
    had taken its blocks, so the node's memory grew with the sessions written, past `--kv-max-bytes`,
    and `switchboard_cache_kv_sessions` counted sessions that had no block left."""

    backend = "memory"

    def __init__(self, max_bytes: int, *, on_evict: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.time, sweep_interval_s: float = 1.0) -> None:
        self.max_bytes = max_bytes
        self._on_evict = on_evict or (lambda reason, n: None)
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._owners: dict[bytes, set[str]] = {}
        self._sessions: dict[str, _Session] = {}
        self._expiries: list[tuple[float, str]] = []
        self._bytes = 0
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="cache-node-kv-sweeper")

    async def aclose(self) -> None:
        await stop_tasks(self._sweeper)
        self._sweeper = None

    def stats(self) -> KVStats:
        return KVStats(len(self._blocks), self._bytes, len(self._sessions))

    async def put(self, session_id: str, frames: Sequence[bytes], links: Sequence[bytes], ttl_s: float) -> int:
        """Store `frames` and link them and the already stored blocks `links` to the session."""
        now = self._clock()
        sess = self._sessions.get(session_id)
        if sess is None or sess.expires_at <= now:
            if sess is not None:
                self._drop(session_id, EVICT_TTL)
            sess = self._sessions[session_id] = _Session(now + ttl_s)
        else:
            sess.expires_at = now + ttl_s
        heapq.heappush(self._expiries, (sess.expires_at, session_id))
        stored = 0
        # Tail first, head last: the head of a chain (shared by more prefixes, and useless to lose
        # since a fetch takes the leading run) ends up most recently used, so the LRU takes tails first.
        for frame in reversed(frames):
            h = peek_hash(frame)
            if len(frame) > self.max_bytes:
                continue
            old = self._blocks.pop(h, None)
            if old is not None:
                self._bytes -= len(old)
            self._blocks[h] = frame
            self._bytes += len(frame)
            stored += 1
        for h in reversed(links):
            if h in self._blocks:
                self._blocks.move_to_end(h)
        for h in (*links, *(peek_hash(f) for f in frames)):  # the session's index in prefix order
            if h in self._blocks:
                self._link(h, session_id, sess)
        evicted = 0
        while self._bytes > self.max_bytes and self._blocks:
            h, frame = self._blocks.popitem(last=False)
            self._bytes -= len(frame)
            for sid in self._owners.pop(h, ()):
                s = self._sessions.get(sid)
                if s is not None:
                    s.hashes.pop(h, None)
                    if not s.hashes:  # links nothing now: forgotten (the class docstring)
                        del self._sessions[sid]
            evicted += 1
        if not sess.hashes:
            self._sessions.pop(session_id, None)
        if evicted:
            self._on_evict(EVICT_LRU, evicted)
        return stored

    async def fetch(self, hashes: Sequence[bytes]) -> list[bytes]:
        out = []
        for h in hashes:
            frame = self._blocks.get(h)
            if frame is None:
                break
            out.append(frame)
        for h in reversed(hashes[: len(out)]):  # tail first: the head stays most recently used
            self._blocks.move_to_end(h)
        return out

    async def session_blocks(self, session_id: str) -> list[bytes]:
        sess = self._sessions.get(session_id)
        return [h for h in sess.hashes if h in self._blocks] if sess is not None else []

    async def drop_session(self, session_id: str) -> int:
        return self._drop(session_id, EVICT_SESSION) if session_id in self._sessions else 0

    def sweep(self) -> int:
        """Expire every session past its TTL now (and the blocks only it linked); returns blocks dropped."""
        now, dropped = self._clock(), 0
        while self._expiries and self._expiries[0][0] <= now:
            _, sid = heapq.heappop(self._expiries)
            sess = self._sessions.get(sid)
            if sess is not None and sess.expires_at <= now:
                dropped += self._drop(sid, EVICT_TTL)
        if len(self._expiries) > 2 * len(self._sessions) + 1024:
            self._expiries = [(s.expires_at, sid) for sid, s in self._sessions.items()]
            heapq.heapify(self._expiries)
        return dropped

    def _link(self, h: bytes, session_id: str, sess: _Session) -> None:
        sess.hashes[h] = None
        self._owners.setdefault(h, set()).add(session_id)

    def _drop(self, session_id: str, reason: str) -> int:
        sess = self._sessions.pop(session_id)
        dropped = 0
        for h in sess.hashes:
            owners = self._owners.get(h)
            if owners is None:
                continue
            owners.discard(session_id)
            if not owners:
                del self._owners[h]
                frame = self._blocks.pop(h, None)
                if frame is not None:
                    self._bytes -= len(frame)
                    dropped += 1
        if dropped:
            self._on_evict(reason, dropped)
        return dropped

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            self.sweep()


class RedisKVStore:
    """Blocks as Redis strings (``<prefix>kv:b:<hash>``), a session's links as a set
    (``<prefix>kv:s:<id>``), both expiring with the session's TTL (a put refreshes it on every block
    it links). Redis enforces the byte budget itself (its ``maxmemory`` with an LRU policy); the
    block and byte gauges come from a SCAN every `stats_interval_s`. Failures raise Overloaded (503)."""

    backend = "redis"

    def __init__(self, url: str, prefix: str, *, stats_interval_s: float = 10.0) -> None:
        import redis.asyncio as aioredis  # only Redis-backed nodes pay for the import

        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
        self._prefix = prefix
        self._stats_interval_s = stats_interval_s
        self._stats = KVStats(0, 0, 0)
        self._task: asyncio.Task[None] | None = None

    def _bkey(self, h: bytes) -> str:
        return f"{self._prefix}kv:b:{h.hex()}"

    def _skey(self, session_id: str) -> str:
        return f"{self._prefix}kv:s:{session_id}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._stats_loop(), name="cache-node-kv-redis-stats")

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        await self._redis.aclose()

    def stats(self) -> KVStats:
        return self._stats

    async def put(self, session_id: str, frames: Sequence[bytes], links: Sequence[bytes], ttl_s: float) -> int:
        px = max(1, int(ttl_s * 1000))
        hashes = [peek_hash(f) for f in frames]
        with redis_errors():
            async with self._redis.pipeline(transaction=False) as pipe:
                for h, frame in zip(hashes, frames):
                    pipe.set(self._bkey(h), bytes(frame), px=px)
                for h in links:
                    pipe.pexpire(self._bkey(h), px)
                members = [h.hex() for h in (*hashes, *links)]
                if members:
                    pipe.sadd(self._skey(session_id), *members)
                pipe.pexpire(self._skey(session_id), px)
                await pipe.execute()
        return len(frames)

    async def fetch(self, hashes: Sequence[bytes]) -> list[bytes]:
        if not hashes:
            return []
        with redis_errors():
            values = await self._redis.mget([self._bkey(h) for h in hashes])
        out = []
        for v in values:
            if v is None:
                break
            out.append(v if isinstance(v, bytes) else bytes(v, "latin-1"))  # the client returns bytes (no decoding)
        return out

    async def session_blocks(self, session_id: str) -> list[bytes]:
        """The blocks linked to the session (unordered: a Redis set)."""
        with redis_errors():
            members = await self._redis.smembers(self._skey(session_id))
        return [bytes.fromhex(m.decode() if isinstance(m, bytes) else m) for m in members]

    async def drop_session(self, session_id: str) -> int:
        """The session's set goes; its blocks are left to expire with the TTL they were given (another
        session may link them, and Redis has no cheap reference count)."""
        with redis_errors():
            return int(await self._redis.delete(self._skey(session_id)))

    async def refresh_stats(self) -> KVStats:
        blocks = size = sessions = 0
        cursor = 0
        while True:
            cursor, keys = await self._redis.scan(cursor, match=f"{self._prefix}kv:*", count=1000)
            bkeys = [k for k in keys if b":kv:b:" in (k if isinstance(k, bytes) else k.encode())]
            sessions += len(keys) - len(bkeys)
            if bkeys:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key in bkeys:
                        pipe.strlen(key)
                    size += sum(await pipe.execute())
                blocks += len(bkeys)
            if cursor == 0:
                break
        self._stats = KVStats(blocks, size, sessions)
        return self._stats

    async def _stats_loop(self) -> None:
        while True:
            try:
                await self.refresh_stats()
            except Exception as exc:  # noqa: BLE001 - stats are advisory; never kill the loop
                log.debug("redis kv stats refresh failed: %s", type(exc).__name__)
            await asyncio.sleep(self._stats_interval_s)
