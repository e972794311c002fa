"""A cache node's KV-block API: what shards store after a turn and fetch when a prefix is missing.

    kv = mount_kv(app, settings, hop_dependencies, node_id, registry)   # from data_plane/cache/node.py
    await kv.store.start() ... await kv.store.aclose()                  # in the node's lifespan
    await kv.store.drop_session(session_id)                             # when the transcript is deleted

HTTP (bodies in the binary format of data_plane/kv_wire.py, media type ``application/x-switchboard-kv``)::

    PUT    /v1/kv/sessions/{id}?ttl_s=S  links (hashes already stored) + new frames -> 200 {"stored","linked"}
    POST   /v1/kv/fetch?skip=K           16-byte hashes in prefix order -> 200 the frames of the leading
                                         run this node holds, past the first K (the asker has those);
                                         header X-KV-Run: the run's length (K included)
    GET    /v1/kv/sessions/{id}          200 {"session_id","blocks":[hex hashes]} (prefix order in memory)
    DELETE /v1/kv/sessions/{id}          200 {"session_id","dropped"}: the blocks only it linked go

Who calls it: the shard's KV-block client (data_plane/shard/kv_remote.py), which also places and
replicates blocks over the cache nodes; storage is data_plane/cache/kv_store.py. The same cluster
token as the session API guards it. Block contents (sealed by the shards: the node holds only
ciphertext) are never logged.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from data_plane.cache.kv_store import (
    EVICT_LRU,
    EVICT_SESSION,
    EVICT_TTL,
    KVStore,
    MemoryKVStore,
    RedisKVStore,
)
from data_plane.cache.model import validate_session_id
from data_plane.common.errors import InvalidRequest
from data_plane.common.http_body import read_body
from data_plane.kv_wire import CONTENT_TYPE, HASH_BYTES, KVWireError, decode_put, split_hashes

tracer = trace.get_tracer(__name__)

MAX_FETCH_BLOCKS = 16384
"""Most hashes one fetch may ask for (a 256k-token prefix in 16-token blocks)."""


class KVNodeMetrics:
    """The cache node's KV-block metrics (``switchboard_cache_kv_*``); label values from fixed sets."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Gauge("switchboard_cache_kv_blocks", "KV blocks stored on this cache node.", registry=registry)
        self.bytes = Gauge("switchboard_cache_kv_bytes", "Bytes of KV blocks stored on this cache node.",
                           registry=registry)
        self.sessions = Gauge("switchboard_cache_kv_sessions", "Sessions with KV blocks on this cache node.",
                              registry=registry)
        self.capacity = Gauge("switchboard_cache_kv_capacity_bytes",
                              "This node's KV byte budget (in-memory backend; 0 under Redis).", registry=registry)
        self.evictions = Counter(
            "switchboard_cache_kv_evictions_total",
            "KV blocks dropped by the node (reason lru: byte budget; ttl: last session expired; session: "
            "last session deleted).", ["reason"], registry=registry)
        self.requests = Counter("switchboard_cache_kv_requests_total",
                                "KV-block requests by operation (put|fetch|delete) and result (ok|hit|miss|error).",
                                ["op", "result"], registry=registry)
        self.transfer = Counter("switchboard_cache_kv_transfer_bytes_total",
                                "KV-block bytes received (in: stores) and sent (out: fetches).", ["direction"],
                                registry=registry)
        for reason in (EVICT_LRU, EVICT_TTL, EVICT_SESSION):
            self.evictions.labels(reason)
        for op, results in (("put", ("ok", "error")), ("fetch", ("hit", "miss", "error")),
                            ("delete", ("ok", "error"))):
            for result in results:
                self.requests.labels(op, result)
        for direction in ("in", "out"):
            self.transfer.labels(direction)

    def evicted(self, reason: str, count: int) -> None:
        self.evictions.labels(reason).inc(count)

    def watch(self, store: KVStore) -> None:
        self.blocks.set_function(lambda: store.stats().blocks)
        self.bytes.set_function(lambda: store.stats().bytes)
        self.sessions.set_function(lambda: store.stats().sessions)


@dataclass
class KVNode:
    store: KVStore
    metrics: KVNodeMetrics


def build_kv_store(settings: Any, metrics: KVNodeMetrics) -> KVStore:
    """Redis when the node stores transcripts in Redis (same server, its own keys), else memory."""
    if settings.redis:
        prefix = (settings.redis_prefix or f"switchboard:{settings.member_id}:session:").removesuffix("session:")
        return RedisKVStore(settings.redis, prefix)
    metrics.capacity.set(settings.kv_max_bytes)
    return MemoryKVStore(settings.kv_max_bytes, on_evict=metrics.evicted)


ANNOUNCE_INTERVAL_S = 10.0
"""How often a registered node puts its KV bytes (whole MiB) in its membership meta (``kv_bytes``):
the console's Cluster page shows them; at most one re-registration per interval, only on change."""


async def announce_kv_bytes(agent: Any, store: KVStore, interval_s: float = ANNOUNCE_INTERVAL_S) -> None:
    """Keep ``kv_bytes`` in the node's membership meta (started by data_plane/cache/node.py)."""
    last = None
    while True:
        mib = store.stats().bytes >> 20
        if mib != last:
            agent.set_meta(kv_bytes=str(mib << 20))
            last = mib
        await asyncio.sleep(interval_s)


def mount_kv(app: FastAPI, settings: Any, hop: list[Any], node_id: str, registry: CollectorRegistry,
             store: KVStore | None = None) -> KVNode:
    """Add the KV routes to a cache node's `app`; `settings` is its CacheNodeSettings (``kv_*``
    fields, ``ttl_s``, ``redis``); `hop` the cluster-token dependency of its session API."""
    metrics = KVNodeMetrics(registry)
    kv = store if store is not None else build_kv_store(settings, metrics)
    metrics.watch(kv)

    def span(op: str, request: Request) -> Any:
        """The op's server span, in the shard's trace when it sent one (a turn's KV fetch)."""
        return tracer.start_as_current_span(f"cache_node.kv_{op}", context=propagate.extract(request.headers),
                                            kind=trace.SpanKind.SERVER, attributes={
                                                "switchboard.cache.op": f"kv_{op}", "switchboard.cache.node_id": node_id})

    @app.put("/v1/kv/sessions/{session_id}", dependencies=hop)
    async def put_kv(session_id: str, request: Request,
                     ttl_s: float | None = Query(None, gt=0, le=30 * 24 * 3600.0)) -> JSONResponse:
        validate_session_id(session_id)
        raw = await read_body(request, settings.kv_max_body_bytes)
        with span("put", request) as s:
            try:
                links, frames = decode_put(raw)
            except KVWireError as exc:
                metrics.requests.labels("put", "error").inc()
                raise InvalidRequest(f"not a KV store body: {exc}", code="invalid_kv_body") from None
            stored = await kv.put(session_id, [bytes(f) for f in frames], links,
                                  ttl_s if ttl_s is not None else settings.ttl_s)
            s.set_attribute("switchboard.kv.blocks", stored)
            metrics.requests.labels("put", "ok").inc()
            metrics.transfer.labels("in").inc(len(raw))
        return JSONResponse({"stored": stored, "linked": len(links)})

    @app.post("/v1/kv/fetch", dependencies=hop)
    async def fetch_kv(request: Request, skip: int = Query(0, ge=0, le=MAX_FETCH_BLOCKS)) -> Response:
        raw = await read_body(request, MAX_FETCH_BLOCKS * HASH_BYTES)
        started = time.perf_counter()
        with span("fetch", request) as s:
            try:
                hashes = split_hashes(raw)
            except KVWireError as exc:
                metrics.requests.labels("fetch", "error").inc()
                raise InvalidRequest(str(exc), code="invalid_kv_body") from None
            frames = await kv.fetch(hashes)
            body = b"".join(frames[skip:])
            s.set_attribute("switchboard.kv.asked", len(hashes))
            s.set_attribute("switchboard.kv.blocks", len(frames))
            s.set_attribute("switchboard.kv.seconds", time.perf_counter() - started)
        metrics.requests.labels("fetch", "hit" if frames else "miss").inc()
        metrics.transfer.labels("out").inc(len(body))
        return Response(body, media_type=CONTENT_TYPE, headers={"X-KV-Run": str(len(frames))})

    @app.get("/v1/kv/sessions/{session_id}", dependencies=hop)
    async def list_kv(session_id: str) -> JSONResponse:
        validate_session_id(session_id)
        return JSONResponse({"session_id": session_id, "blocks": [h.hex() for h in await kv.session_blocks(session_id)]})

    @app.delete("/v1/kv/sessions/{session_id}", dependencies=hop)
    async def delete_kv(session_id: str) -> JSONResponse:
        validate_session_id(session_id)
        dropped = await kv.drop_session(session_id)
        metrics.requests.labels("delete", "ok").inc()
        return JSONResponse({"session_id": session_id, "dropped": dropped})

    return KVNode(kv, metrics)
