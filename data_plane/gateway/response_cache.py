"""The response cache: identical deterministic requests of one tenant answered without a shard.

    cache = ResponseCache(store, ResponseCacheMetrics(registry), ttl_s=600)
    policy = cache_policy(req, request.headers)           # read/write, or why not (a Decision)
    key = cache_key(tenant, upstream_body, whole_prompt)
    reply = await cache.get(key, tenant, api)             # CachedReply | None (a miss or an error)
    stream = ReplayStream(reply)                          # what Completion reads instead of a shard
    cache.put_later(key, tenant, reply)                   # off the request path, after the reply

Only deterministic requests are cached (temperature 0, or a seed), only within one tenant (the
tenant is in the key and the record is sealed with the tenant as its owner, so another tenant's
lookup is a miss, never a hit), and a session's request only when its whole transcript is
identical (the key holds the whole prompt, not only the window). Opt out per request the way
LiteLLM's proxy does: body ``"cache": {"no-cache": true}`` skips the lookup, ``{"no-store": true}``
skips the write; the ``Cache-Control: no-cache`` / ``no-store`` request headers do the same.

Entries live on the cache nodes beside the sessions but under their own route and byte budget
(``/v1/response-cache/{key}``, data_plane/cache/node.py: TTL, LRU by bytes), one replica each,
sealed like transcripts. A hit replays through the chat path's own output (the output filter,
SSE or one body, usage with every prompt token cached, the ledger with shard ``response-cache``)
and needs no admission slot, so it keeps serving when shards are saturated or shed; a cache node
that fails is a miss, never an error.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from data_plane.cache.client import SessionStore
from data_plane.common.errors import SwitchboardError
from data_plane.membership.view import Member
from data_plane.routing.upstream import Delta, Event, Finish, UsageEvent

log = logging.getLogger(__name__)

REPLY_ROLE = "x-cached-reply"
CACHE_MEMBER = Member(id="response-cache", service="cache", url="")
"""The 'shard' a hit came from, as the ledger and the span record it."""
VOLATILE = ("request_id", "deadline", "priority", "kv_replicas", "kv_ttl_s", "session_id")
"""Upstream body fields that do not change the reply."""
MAX_ENTRY_BYTES = 256 * 1024


class Decision(str, enum.Enum):
    """What the cache did for one request (the metric's `result` label)."""

    HIT = "hit"
    MISS = "miss"
    ERROR = "error"
    """The cache nodes did not answer: served by a shard."""
    BYPASS = "bypass"
    """The request opted out (no-cache)."""
    NONDETERMINISTIC = "nondeterministic"


@dataclass(frozen=True)
class CachePolicy:
    read: bool
    write: bool
    decision: Decision | None = None
    """Set when the cache is not read: why."""


@dataclass(frozen=True)
class CachedReply:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def cache_policy(temperature: float | None, seed: int | None, uncacheable: Any, cache_field: Mapping[str, Any] | None,
                 headers: Mapping[str, str]) -> CachePolicy:
    """Whether to read and write the cache for a request with these fields and headers; `uncacheable`:
    what a replayed text could not give back (tool calls, several choices, logprobs)."""
    if not (temperature == 0 or seed is not None) or uncacheable:
        return CachePolicy(False, False, Decision.NONDETERMINISTIC)
    control = (headers.get("cache-control") or "").lower()
    fields = cache_field or {}
    no_cache = "no-cache" in control or bool(fields.get("no-cache"))
    no_store = "no-store" in control or bool(fields.get("no-store"))
    return CachePolicy(not no_cache, not no_store, Decision.BYPASS if no_cache else None)


def cache_key(tenant: str, body: Mapping[str, Any], prompt: Any) -> str:
    """The key of a request: its tenant, every upstream field that shapes the reply, and the whole prompt."""
    material = {"tenant": tenant, "body": {k: v for k, v in body.items() if k not in VOLATILE}, "prompt": prompt}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return "rc_" + digest


class ResponseCacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter("switchboard_response_cache_lookups_total",
                               "Response cache outcomes per request by API (chat|responses) and result "
                               "(hit|miss|error|bypass|nondeterministic).", ["api", "result"], registry=registry)
        self.stores = Counter("switchboard_response_cache_stores_total",
                              "Replies written to the response cache by result (ok|too_large|error).", ["result"],
                              registry=registry)
        for api in ("chat", "responses"):
            for d in Decision:
                self.lookups.labels(api, d.value)
        for result in ("ok", "too_large", "error"):
            self.stores.labels(result)


class ResponseCache:
    """Cached replies on the cache nodes (see the module docstring); `aclose` ends pending writes."""

    def __init__(self, store: SessionStore, metrics: ResponseCacheMetrics, ttl_s: float) -> None:
        self.store = store
        self.metrics = metrics
        self.ttl_s = ttl_s
        self._writes: set[asyncio.Task[None]] = set()

    @staticmethod
    def _owner(tenant: str) -> str:
        return "tenant:" + hashlib.sha256(tenant.encode()).hexdigest()

    def count(self, api: str, decision: Decision) -> None:
        self.metrics.lookups.labels(api, decision.value).inc()

    async def get(self, key: str, tenant: str, api: str) -> CachedReply | None:
        try:
            found = await self.store.load(key, self._owner(tenant), 1)
            reply = None if found is None else _reply(found.messages)
        except (SwitchboardError, ValueError, KeyError) as exc:
            log.warning("response cache lookup failed (%s): served by a shard", type(exc).__name__)
            self.count(api, Decision.ERROR)
            return None
        self.count(api, Decision.HIT if reply is not None else Decision.MISS)
        return reply

    def put_later(self, key: str, tenant: str, reply: CachedReply) -> None:
        content = json.dumps(reply.__dict__, ensure_ascii=False)
        if len(content) > MAX_ENTRY_BYTES:
            self.metrics.stores.labels("too_large").inc()
            return
        task = asyncio.get_running_loop().create_task(self._put(key, tenant, content), name="response-cache-put")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _put(self, key: str, tenant: str, content: str) -> None:
        try:
            await self.store.save(key, self._owner(tenant), [{"role": REPLY_ROLE, "content": content}], 1, 1,
                                  ttl_s=self.ttl_s)
            self.metrics.stores.labels("ok").inc()
        except SwitchboardError as exc:  # a stale version: the same reply raced in; else the node failed
            self.metrics.stores.labels("error").inc()
            log.info("response cache write skipped: %s", exc.code)

    async def drain(self) -> None:
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)


def _reply(messages: Any) -> CachedReply | None:
    if len(messages) != 1 or messages[0]["role"] != REPLY_ROLE:
        return None
    return CachedReply(**json.loads(messages[0]["content"]))


class ReplayStream:
    """A cached reply as the event stream Completion reads from a shard (data_plane/gateway/stream.py)."""

    member = CACHE_MEMBER
    attempts = 0

    def __init__(self, reply: CachedReply) -> None:
        self.reply = reply

    async def batches(self) -> AsyncIterator[list[Event]]:
        r = self.reply
        yield [Delta(r.text), Finish(r.finish_reason),
               UsageEvent(r.prompt_tokens, r.completion_tokens, cached_tokens=r.prompt_tokens)]

    def close(self) -> None:
        """Nothing to release."""
