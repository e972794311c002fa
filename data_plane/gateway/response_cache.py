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

In front of the nodes each gateway keeps the replies it wrote or read lately in its own memory
(`LocalReplies`: bounded bytes, LRU, never past the node entry's own expiry): a hit there costs no
round trip to a cache node, which on a loaded host was most of a hit's time (two more processes to
wake per hit). A reply is immutable for its key, so a local copy is never stale, only expired; the
key holds the tenant and the entry its owner, both checked. The lookup's time goes to
`switchboard_response_cache_lookup_seconds{api,result,source}` and to the span.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.cache.client import SessionStore
from data_plane.common.errors import SwitchboardError
from data_plane.membership.view import Member
from data_plane.routing.upstream import Delta, Event, Fingerprint, Finish, UsageEvent

log = logging.getLogger(__name__)

REPLY_ROLE = "x-cached-reply"
CACHE_MEMBER = Member(id="response-cache", service="cache", url="")
"""The 'shard' a hit came from, as the ledger and the span record it."""
VOLATILE = ("request_id", "deadline", "priority", "kv_replicas", "kv_ttl_s", "session_id")
"""Upstream body fields that do not change the reply."""
MAX_ENTRY_BYTES = 256 * 1024
ENTRY_FORMAT = 2
"""In the key: an entry's fields. 2 added `system_fingerprint`, which a gateway of format 1 (it built its
`CachedReply` from every stored field) could not read, so the two never share an entry."""
LOCAL_BYTES = 16 * 1024 * 1024
"""Default byte budget of a gateway's own copies (`--response-cache-local-bytes`; 0: none)."""
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Source(str, enum.Enum):
    """Where a lookup was answered (the lookup histogram's `source` label)."""

    LOCAL = "local"
    """This gateway's own copies (LocalReplies)."""
    NODES = "nodes"


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
    system_fingerprint: str | None = None
    """The fingerprint of the shard that made it (data_plane/shard/engines/fingerprint.py): a replay says what
    made the text it replays, not what serves now (None: an entry stored before it was kept)."""


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
    material = {"tenant": tenant, "body": {k: v for k, v in body.items() if k not in VOLATILE}, "prompt": prompt,
                "format": ENTRY_FORMAT}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return "rc_" + digest


CACHED_APIS = ("chat", "responses", "text_completion")
"""The `api` label: the OPERATION of the handler (chat.py, responses.py, completions.py: the legacy Completions API)."""


class ResponseCacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter("switchboard_response_cache_lookups_total",
                               "Response cache outcomes per request by API (chat|responses|text_completion) and result "
                               "(hit|miss|error|bypass|nondeterministic).", ["api", "result"], registry=registry)
        self.stores = Counter("switchboard_response_cache_stores_total",
                              "Replies written to the response cache by result (ok|too_large|error).", ["result"],
                              registry=registry)
        for api in CACHED_APIS:
            for d in Decision:
                self.lookups.labels(api, d.value)
        for result in ("ok", "too_large", "error"):
            self.stores.labels(result)
        self.lookup_seconds = Histogram(
            "switchboard_response_cache_lookup_seconds",
            "Time of a response cache lookup by API, result (hit|miss|error) and where it was answered "
            "(local: this gateway's copies; nodes: the cache nodes).", ["api", "result", "source"],
            buckets=LOOKUP_BUCKETS, registry=registry)
        for api in CACHED_APIS:
            for result, source in (("hit", "local"), ("hit", "nodes"), ("miss", "nodes"), ("error", "nodes")):
                self.lookup_seconds.labels(api, result, source)
        self.local_bytes = Gauge("switchboard_response_cache_local_bytes",
                                 "Bytes of cached replies this gateway keeps in its own memory.", registry=registry)


class LocalReplies:
    """A gateway's own copies of cached replies: LRU within `max_bytes`, each until its expiry.

        local = LocalReplies(16 << 20)
        local.put(key, owner, reply, expires_at=time.time() + 600)
        local.get(key, owner)          # CachedReply | None (absent, expired, or another owner's)
    """

    def __init__(self, max_bytes: int, on_size: Callable[[float], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._on_size = on_size
        self._entries: OrderedDict[str, tuple[str, CachedReply, float, int]] = OrderedDict()

    @staticmethod
    def _size(key: str, reply: CachedReply) -> int:
        return len(key) + len(reply.text.encode()) + 128

    def get(self, key: str, owner: str) -> CachedReply | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[2] <= time.time():
            self._drop(key)
            return None
        if entry[0] != owner:  # the key holds the tenant already: this is a second lock on the same door
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: str, owner: str, reply: CachedReply, expires_at: float) -> None:
        size = self._size(key, reply)
        if size > self.max_bytes or expires_at <= time.time():
            return
        self._drop(key)
        self._entries[key] = (owner, reply, expires_at, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._sized()

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[3]
            self._sized()

    def _sized(self) -> None:
        if self._on_size is not None:
            self._on_size(self.bytes)

    def __len__(self) -> int:
        return len(self._entries)


class ResponseCache:
    """Cached replies on the cache nodes (see the module docstring); `aclose` ends pending writes."""

    def __init__(self, store: SessionStore, metrics: ResponseCacheMetrics, ttl_s: float,
                 local_bytes: int = LOCAL_BYTES) -> None:
        self.store = store
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.local = LocalReplies(local_bytes, metrics.local_bytes.set) if local_bytes > 0 else None
        self._writes: set[asyncio.Task[None]] = set()

    @staticmethod
    def _owner(tenant: str) -> str:
        return "tenant:" + hashlib.sha256(tenant.encode()).hexdigest()

    def count(self, api: str, decision: Decision) -> None:
        self.metrics.lookups.labels(api, decision.value).inc()

    async def get(self, key: str, tenant: str, api: str) -> CachedReply | None:
        """The reply cached for `key` and `tenant`: this gateway's copy, else the cache nodes'."""
        t0, owner = time.perf_counter(), self._owner(tenant)
        reply = self.local.get(key, owner) if self.local is not None else None
        if reply is not None:
            self._looked(api, Decision.HIT, Source.LOCAL, t0)
            return reply
        try:
            found = await self.store.load(key, owner, 1)
            reply = None if found is None else _reply(found.messages)
        except (SwitchboardError, ValueError, KeyError) as exc:
            log.warning("response cache lookup failed (%s): served by a shard", type(exc).__name__)
            self._looked(api, Decision.ERROR, Source.NODES, t0)
            return None
        if reply is not None and found is not None and self.local is not None:
            ttl_left = found.ttl_left(time.time())
            self.local.put(key, owner, reply, time.time() + (self.ttl_s if ttl_left is None else min(self.ttl_s, ttl_left)))
        self._looked(api, Decision.HIT if reply is not None else Decision.MISS, Source.NODES, t0)
        return reply

    def _looked(self, api: str, decision: Decision, source: Source, t0: float) -> None:
        trace.get_current_span().set_attribute("switchboard.response_cache.source", source.value)
        self.count(api, decision)
        self.metrics.lookup_seconds.labels(api, decision.value, source.value).observe(time.perf_counter() - t0)

    def put_later(self, key: str, tenant: str, reply: CachedReply) -> None:
        content = json.dumps(reply.__dict__, ensure_ascii=False)
        if len(content) > MAX_ENTRY_BYTES:
            self.metrics.stores.labels("too_large").inc()
            return
        if self.local is not None:  # this gateway's next identical request needs no round trip
            self.local.put(key, self._owner(tenant), reply, time.time() + self.ttl_s)
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
    stored = json.loads(messages[0]["content"])
    return CachedReply(**{f.name: stored[f.name] for f in dataclasses.fields(CachedReply) if f.name in stored})


class ReplayStream:
    """A cached reply as the event stream Completion reads from a shard (data_plane/gateway/stream.py)."""

    member = CACHE_MEMBER
    attempts = 0

    def __init__(self, reply: CachedReply) -> None:
        self.reply = reply

    async def batches(self) -> AsyncIterator[list[Event]]:
        r = self.reply
        yield [*([Fingerprint(r.system_fingerprint)] if r.system_fingerprint else []), Delta(r.text), Finish(r.finish_reason),
               UsageEvent(r.prompt_tokens, r.completion_tokens, cached_tokens=r.prompt_tokens)]

    def close(self) -> None:
        """Nothing to release."""
