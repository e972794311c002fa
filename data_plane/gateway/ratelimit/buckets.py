"""The token buckets behind data_plane/gateway/ratelimit/limiter.py and where their state lives.

    buckets = [Bucket("key:k1", "requests", limit=60, cost=1), Bucket("key:k1", "tokens", 40_000, 900)]
    states = await LocalBackend().take(buckets)          # all pay, or none; how each stands
    await RedisBackend("redis://127.0.0.1:6379/0").take(buckets)   # the same, shared by gateways

`decide` is the whole algorithm (integer GCRA, see data_plane/gateway/ratelimit/limiter.py); the local backend
runs it in process, the Redis one runs the same arithmetic in one Lua script per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

PERIOD_US = 60_000_000
"""Every limit here is per minute."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    """``cost`` units from a ``limit``-per-minute allowance of ``scope`` (``key:ID`` or ``tier:NAME``)."""

    scope: str
    kind: str
    limit: int
    cost: int
    period_us: int = PERIOD_US

    @property
    def key(self) -> str:
        return f"{self.scope}:{self.kind}"


@dataclass(frozen=True)
class BucketState:
    allowed: bool
    """This bucket alone could pay the cost (the request is admitted only if all could)."""
    remaining: int
    """Whole units left after this request (before it, when the request was refused)."""
    reset_us: int
    """Until the bucket is full again."""
    retry_us: int
    """0 when allowed; else until the cost fits; -1 when it never can (cost above the limit)."""


class BackendUnavailable(Exception):
    """The backend could not be reached; the limiter fails open to its local fallback."""


class Backend(Protocol):
    """Where bucket state lives. `take` is called once per request before any work, `adjust`
    once after it (settlement); both are atomic over the buckets they are given."""

    async def take(self, buckets: Sequence[Bucket]) -> list[BucketState]:
        """Take every bucket's cost, or none of them if any one cannot pay; say how each stands."""
        ...

    async def adjust(self, buckets: Sequence[Bucket]) -> None:
        """Add each bucket's cost (negative: a refund) now, unconditionally."""
        ...

    async def peek(self, buckets: Sequence[Bucket]) -> list[BucketState]:
        """How each bucket stands now, as `take` would say for a cost of 0; stores nothing."""
        ...

    async def aclose(self) -> None: ...


State = tuple[int, int, int]
"""A bucket's stored state: (fill, at, limit): its fill in units x period_us, as of `at` (unix
microseconds), under the per-period `limit` it was stored with."""


def _fill_at(state: State | None, now: int, b: Bucket) -> int:
    """The fill at `now`: the stored fill less the continuous refill since (at the stored limit's pace).

    A fill stored under another limit (the tier policy changed) is held to this limit's capacity: the
    units it counts are kept, but never more than a full bucket. Unclamped, lowering a tier's RPM from
    60 to 3 left a key that had just used its 60 owing 20 minutes of the new pace, not one minute's;
    debt under an unchanged limit (a settlement beyond the estimate) is still kept exactly."""
    if state is None:
        return 0
    fill, at, limit = state
    elapsed = now - at
    if elapsed > 0:  # a clock that steps back refills nothing
        fill = max(0, fill - elapsed * limit)
    return fill if limit == b.limit else min(fill, b.limit * b.period_us)


def decide(states: Sequence[State | None], now: int,
           buckets: Sequence[Bucket]) -> tuple[list[BucketState], list[State] | None]:
    """Take every bucket's cost at `now`, or none; integer arithmetic, so exact.

    Returns how each bucket stands and, when all could pay, the states to store."""
    fills = [_fill_at(st, now, b) for st, b in zip(states, buckets)]
    after = [f + b.cost * b.period_us for f, b in zip(fills, buckets)]
    allowed, retry = [], []
    for a, b in zip(after, buckets):
        capacity = b.limit * b.period_us
        if b.cost > b.limit:
            allowed.append(False)
            retry.append(-1)
        elif a > capacity:
            allowed.append(False)
            retry.append(-(-(a - capacity) // b.limit))
        else:
            allowed.append(True)
            retry.append(0)
    ok = all(allowed)
    out = []
    for f, a, b, yes, r in zip(fills, after, buckets, allowed, retry):
        fill = a if ok else f
        remaining = max(0, min(b.limit, (b.limit * b.period_us - fill) // b.period_us))
        out.append(BucketState(yes, remaining, -(-fill // b.limit), r))
    return out, ([(a, now, b.limit) for a, b in zip(after, buckets)] if ok else None)


def _now_us() -> int:
    return time.time_ns() // 1000


class LocalBackend:
    """In-process buckets. Safe under asyncio: a decision has no await inside it."""

    PRUNE_EVERY = 4096

    def __init__(self, clock: Callable[[], int] = _now_us) -> None:
        self._clock = clock
        self._state: dict[str, State] = {}
        self._empty_at: dict[str, int] = {}
        self._ops = 0

    async def take(self, buckets: Sequence[Bucket]) -> list[BucketState]:
        now = self._clock()
        out, new = decide([self._rebased(b, now) for b in buckets], now, buckets)
        if new is not None:
            for b, state in zip(buckets, new):
                self._store(b, state)
        self._ops += 1
        if self._ops % self.PRUNE_EVERY == 0:  # an empty bucket needs no state
            for key in [k for k, t in self._empty_at.items() if t <= now]:
                del self._state[key], self._empty_at[key]
        return out

    async def adjust(self, buckets: Sequence[Bucket]) -> None:
        self.adjust_now(buckets)

    async def peek(self, buckets: Sequence[Bucket]) -> list[BucketState]:
        now = self._clock()
        return decide([self._state.get(b.key) for b in buckets], now, buckets)[0]  # new states dropped

    def adjust_now(self, buckets: Sequence[Bucket]) -> None:
        now = self._clock()
        for b in buckets:
            self._store(b, (max(0, _fill_at(self._state.get(b.key), now, b) + b.cost * b.period_us), now, b.limit))

    def _rebased(self, b: Bucket, now: int) -> State | None:
        """The bucket's state, re-stored under `b.limit` at `now` if it was stored under another limit
        (held to the new capacity once, then refilled at the new pace, refused requests or not)."""
        state = self._state.get(b.key)
        if state is not None and state[2] != b.limit:
            state = (_fill_at(state, now, b), now, b.limit)
            self._store(b, state)
        return self._state.get(b.key)

    def _store(self, b: Bucket, state: State) -> None:
        if state[0] > 0:
            self._state[b.key] = state
            self._empty_at[b.key] = state[1] - (-state[0] // b.limit)
        else:
            self._state.pop(b.key, None)
            self._empty_at.pop(b.key, None)

    async def aclose(self) -> None:
        return None


_LUA = """
-- Exact token buckets over several keys, all or nothing (data_plane/gateway/ratelimit/limiter.py: decide).
-- KEYS: bucket keys, each a hash {f = fill in units x period_us, t = as of, unix us, l = the limit it was
-- stored under (absent before it was kept: taken as the current one); a fill stored under another limit
-- is held to this limit's capacity, as _fill_at does.
-- ARGV[1]: 'take' | 'adjust' | 'peek' (as 'take', storing nothing); ARGV[2]: now in us ('' = this server's clock); then per bucket:
-- limit, period_us, cost. 'take' returns per bucket: allowed (1/0), remaining, reset_us,
-- retry_us (-1: never fits). Lua numbers are doubles: every value here is an integer below
-- 2^53 and every division is corrected to the exact integer quotient.
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[2])
end
local function idiv(a, b)
  local q = math.floor(a / b)
  if (q + 1) * b <= a then q = q + 1 elseif q * b > a then q = q - 1 end
  return q
end
local function cdiv(a, b) return -idiv(-a, b) end
local function store(key, fill, limit)
  if fill > 0 then
    redis.call('HSET', key, 'f', string.format('%.0f', fill), 't', string.format('%.0f', now),
               'l', string.format('%.0f', limit))
    redis.call('PEXPIRE', key, cdiv(cdiv(fill, limit), 1000) + 1000)
  else
    redis.call('DEL', key)
  end
end
local function fill_at(key, limit, period)
  local v = redis.call('HMGET', key, 'f', 't', 'l')
  if not v[1] then return 0 end
  local fill, elapsed = tonumber(v[1]), now - tonumber(v[2])
  local was = tonumber(v[3]) or limit
  if elapsed > 0 then
    if elapsed >= period + cdiv(fill, was) then fill = 0 else fill = math.max(0, fill - elapsed * was) end
  end
  if was ~= limit and ARGV[1] ~= 'peek' then  -- re-stored under the new limit now, so it refills at the new pace from here
    fill = math.min(fill, limit * period)
    store(key, fill, limit)
  end
  return fill
end
local n = #KEYS
local lim, per, cost = {}, {}, {}
for i = 1, n do
  local b = 2 + (i - 1) * 3
  lim[i], per[i], cost[i] = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
end
if ARGV[1] == 'adjust' then
  for i = 1, n do
    store(KEYS[i], math.max(0, fill_at(KEYS[i], lim[i], per[i]) + cost[i] * per[i]), lim[i])
  end
  return {}
end
local fills, after, allowed, retry = {}, {}, {}, {}
local ok = true
for i = 1, n do
  local capacity = lim[i] * per[i]
  fills[i] = fill_at(KEYS[i], lim[i], per[i])
  after[i] = fills[i] + cost[i] * per[i]
  if cost[i] > lim[i] then
    allowed[i], retry[i] = 0, -1
  elseif after[i] > capacity then
    allowed[i], retry[i] = 0, cdiv(after[i] - capacity, lim[i])
  else
    allowed[i], retry[i] = 1, 0
  end
  if allowed[i] == 0 then ok = false end
end
local out = {}
for i = 1, n do
  local fill = fills[i]
  if ok and ARGV[1] ~= 'peek' then
    fill = after[i]
    store(KEYS[i], fill, lim[i])
  elseif ok then
    fill = after[i]
  end
  out[#out + 1] = allowed[i]
  out[#out + 1] = math.max(0, math.min(lim[i], idiv(lim[i] * per[i] - fill, per[i])))
  out[#out + 1] = cdiv(fill, lim[i])
  out[#out + 1] = retry[i]
end
return out
"""


class RedisBackend:
    """Buckets on one Redis server, shared by every gateway; one atomic script call per request.

    ``clock`` (microseconds) is for tests; by default the Redis server's clock decides, so
    gateways whose clocks disagree still share one exact limit."""

    def __init__(self, url: str, *, prefix: str = "switchboard:rl:", timeout_s: float = 0.5,
                 max_connections: int = 32, clock: Callable[[], int] | None = None) -> None:
        import redis.asyncio as aioredis

        # A bounded pool: a burst of requests queues for a connection instead of opening hundreds.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=2 * timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s)
        self._pool = pool
        self._redis = aioredis.Redis(connection_pool=pool)
        self._script = self._redis.register_script(_LUA)
        self._prefix = prefix
        self._clock = clock

    async def _call(self, mode: str, buckets: Sequence[Bucket]) -> list[int]:
        from redis.exceptions import RedisError

        args: list[str | int] = [mode, "" if self._clock is None else self._clock()]
        for b in buckets:
            args += [b.limit, b.period_us, b.cost]
        try:
            return list(await self._script(keys=[self._prefix + b.key for b in buckets], args=args))
        except (TimeoutError, RedisError, OSError) as exc:  # the one place Redis errors are mapped
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def take(self, buckets: Sequence[Bucket]) -> list[BucketState]:
        raw = await self._call("take", buckets)
        return [BucketState(bool(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]))
                for i in range(0, len(raw), 4)]

    async def adjust(self, buckets: Sequence[Bucket]) -> None:
        await self._call("adjust", buckets)

    async def peek(self, buckets: Sequence[Bucket]) -> list[BucketState]:
        raw = await self._call("peek", buckets)
        return [BucketState(bool(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]))
                for i in range(0, len(raw), 4)]

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self._pool.disconnect()


BACKENDS: dict[str, Callable[..., Backend]] = {"local": LocalBackend, "redis": RedisBackend}


