"""A cache node: keeps whole session transcripts, in memory (TTL + LRU by bytes, fair between owners) or in Redis.

    switchboard cache-node --port 8201                                  # in-memory, 256 MiB
    switchboard cache-node --port 8202 --redis redis://127.0.0.1:6379/0 --registry-url http://127.0.0.1:8300
    SWITCHBOARD_CACHE_MAX_BYTES=67108864 switchboard cache-node --port 8203
    switchboard cache-node --port 8204 --snapshot-file .switchboard/cache/cache-0.jsonl   # kept across restarts

HTTP API (errors in the OpenAI shape)::

    GET    /v1/sessions/{id}   200 {"session_id","owner","messages","version","updated_at","expires_at"}
                               404 session_not_found
    PUT    /v1/sessions/{id}   {"owner","messages":[{"role","content"}],"version","ttl_s"?,"updated_at"?,"only_newer"?}
                               200 stored; 409 session_version_conflict (+ "stored_version") when the
                               stored version is higher (or equal, with only_newer: a turn's write):
                               whole records, last writer by version wins
    DELETE /v1/sessions/{id}   200 {"session_id","deleted": bool}; ``/{id}/if-version/N`` (or ``?if_version=N``):
                               only if it holds version N (else "stored_version": what it holds, kept)
    GET|PUT|DELETE /v1/response-cache/{id}   the same for cached replies (the gateway's response
                               cache), in memory with their own byte budget and TTL
    GET    /health             200 ready, 503 when the backend is unreachable
    GET    /metrics            Prometheus; GET /debug/spans recent spans

With a cluster token (``SWITCHBOARD_CLUSTER_TOKEN``, as ``switchboard up`` sets), ``/v1/sessions/*``,
``/v1/response-cache/*``, ``/v1/kv/*`` and ``/debug/spans`` need ``Authorization: Bearer <token>`` (401
otherwise, counted in ``switchboard_cache_refused_total{route}``); without one the node runs open and
warns at start. What it stores is sealed by the gateway (data_plane/common/crypto.py): the node never sees plaintext.

Placement, replication and read-repair are the client's job (:mod:`data_plane.cache.client`);
a node only stores what it is given. Transcript contents are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from data_plane.cache.kv_routes import KVNode, announce_kv_bytes, mount_kv
from data_plane.cache.model import (
    LIMIT_HEADER,
    LIMIT_META,
    SECONDS_BUCKETS,
    Transcript,
    VersionConflict,
    validate_session_id,
)
from data_plane.cache.snapshot import Snapshot
from data_plane.cache.storage import ManagedStorage, MemoryStorage, RedisStorage
from data_plane.common.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SwitchboardError,
    install_error_handlers,
    name_request,
)
from data_plane.common.hop_auth import (
    TOKENS_HELP,
    RefusalMetrics,
    cluster_token_from_env,
    guarded,
    guarded_metrics,
    metrics_token_from_env,
    require_cluster_token,
)
from data_plane.common.http_body import read_json_body
from data_plane.common.http_server import serve
from data_plane.common.settings_cli import REDIS_URL_PATTERN
from data_plane.common.settings_cli import parse_settings as cli_settings
from data_plane.common.tasks import stop_tasks
from data_plane.common.telemetry import (
    configure_process,
    fastapi_options,
    metrics_endpoint,
    recent_spans_endpoint,
)
from data_plane.common.tls import TlsConfig
from data_plane.membership.factory import MEMBERSHIP_URL_PATTERN, membership_from_url
from data_plane.membership.placement import DEFAULT_ZONE, ZONE_PATTERN

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

MiB = 1024 * 1024
MAX_TTL_S = 30 * 24 * 3600.0


class CacheNodeSettings(BaseSettings):
    """Every knob of one cache node: flags first, then ``SWITCHBOARD_CACHE_*``, then defaults."""

    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_CACHE_", extra="ignore", use_attribute_docstrings=True)
    FLAG_ALIASES: ClassVar[dict[str, str]] = {"--registry": "registry_url"}
    """Deprecated flag spellings (data_plane/common/settings_cli.py)."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(8201, ge=1, le=65535)
    """Port to bind."""
    redis: str | None = Field(None, pattern=REDIS_URL_PATTERN)
    """``redis://`` URL: store transcripts in Redis instead of process memory."""
    redis_prefix: str | None = None
    """Redis key prefix (default ``switchboard:<node_id>:session:``, so nodes may share a Redis)."""
    registry_url: str | None = None
    """Embedded membership registry URL (the control plane's); when set the node registers as service ``cache``."""
    membership: str | None = Field(None, pattern=MEMBERSHIP_URL_PATTERN)
    """Membership URL, e.g. ``consul://127.0.0.1:8500``; wins over ``--registry-url``."""
    registration_ttl_s: float = Field(0.8, gt=0.1, le=300)
    """TTL of the membership health check."""
    max_bytes: int = Field(256 * MiB, ge=1024, le=1 << 40)
    """In-memory backend: total bytes of stored records before eviction (the least recently used record of
    the owner holding the most: one API key filling the node evicts its own records, data_plane/cache/storage.py)."""
    snapshot_file: Path | None = None
    """In-memory backend: a file that keeps the records across restarts (read at start, rewritten every
    ``--snapshot-interval-s`` when one changed, and at shutdown; `switchboard up` sets it in its state dir)."""
    snapshot_interval_s: float = Field(10.0, gt=0, le=3600)
    """In-memory backend with ``--snapshot-file``: seconds between rewrites (what a crash can lose)."""
    ttl_s: float = Field(24 * 3600.0, gt=0, le=MAX_TTL_S)
    """Default record TTL when a PUT leaves ``ttl_s`` null."""
    response_cache_max_bytes: int = Field(64 * MiB, ge=1024, le=1 << 40)
    """Bytes of cached replies (the gateway's response cache) kept before LRU eviction: their own budget."""
    response_cache_ttl_s: float = Field(600.0, gt=0, le=MAX_TTL_S)
    """Default TTL of a cached reply when a PUT leaves ``ttl_s`` null."""
    max_body_bytes: int = Field(4 * MiB, ge=1024, le=256 * MiB)
    """Largest accepted PUT body (413 beyond)."""
    kv_max_bytes: int = Field(512 * MiB, ge=0, le=1 << 40)
    """In-memory backend: bytes of KV blocks kept before LRU eviction (their own budget, data_plane/cache/kv_store.py)."""
    kv_max_body_bytes: int = Field(64 * MiB, ge=1024, le=1 << 30)
    """Largest accepted KV store body (413 beyond)."""
    node_id: str | None = None
    """Member id (default ``cache-<hostname>-<port>``)."""
    zone: str = Field(DEFAULT_ZONE, pattern=ZONE_PATTERN)
    """Zone (failure domain) this node runs in: paid sessions keep one replica per zone."""
    advertise_url: str | None = None
    """URL other processes use to reach this node (default ``http://<host>:<port>``)."""

    @property
    def member_id(self) -> str:
        return self.node_id or f"cache-{socket.gethostname()}-{self.port}"

    @property
    def url(self) -> str:
        return self.advertise_url or f"{TlsConfig.from_env().scheme}://{self.host}:{self.port}"


# -- wire schemas ---------------------------------------------------------------------------


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str = Field(min_length=1, max_length=32)
    content: str


class PutSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    owner: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(max_length=100_000)
    version: int = Field(ge=0, le=2**53 - 1)
    ttl_s: float | None = Field(default=None, gt=0, le=MAX_TTL_S)
    updated_at: float | None = Field(default=None, ge=0)
    """Kept when replicating or repairing a record; the node's clock otherwise."""
    only_newer: bool = False
    """A turn's write: refused (409) when this version is already stored, i.e. another gateway's turn on the
    same version got there first (without it an equal version is written over, as a repair's copy is)."""


# -- storage (data_plane/cache/storage.py) ---------------------------------------------------


def build_storage(settings: CacheNodeSettings, metrics: CacheNodeMetrics) -> ManagedStorage:
    if settings.redis:
        prefix = settings.redis_prefix or f"switchboard:{settings.member_id}:session:"
        return RedisStorage(settings.redis, prefix)
    snapshot = Snapshot(settings.snapshot_file) if settings.snapshot_file else None
    return MemoryStorage(settings.max_bytes, on_evict=metrics.evicted, snapshot=snapshot,
                         snapshot_interval_s=settings.snapshot_interval_s, on_snapshot=metrics.snapshot_written)


# -- metrics --------------------------------------------------------------------------------

RESULTS = {
    "get": ("hit", "miss", "error"),
    "put": ("stored", "stale", "error"),
    "delete": ("hit", "miss", "error"),
    "reply_get": ("hit", "miss", "error"),
    "reply_put": ("stored", "stale", "error"),
}
REFUSED_ROUTES = {"sessions": "session API", "response_cache": "response cache API", "kv": "KV block API",
                  "debug_spans": "/debug/spans"}
"""``switchboard_cache_refused_total``'s route label (each guarded API apart: a refused KV fetch, e.g. a shard
without the token, was counted as `sessions`) and the words its 401 names it by; ``metrics`` besides
(/metrics refused: a scraper with neither the metrics nor the cluster token)."""


class CacheNodeMetrics:
    """The cache node's metrics in `registry`; every label value is from a fixed set."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "switchboard_cache_requests_total",
            "Cache node requests by operation and result (hit|miss|stored|stale|error).",
            ["op", "result"],
            registry=registry,
        )
        self.entries = Gauge("switchboard_cache_entries", "Transcripts stored.", registry=registry)
        self.bytes = Gauge("switchboard_cache_bytes", "Bytes of stored transcripts.", registry=registry)
        self.reply_entries = Gauge("switchboard_response_cache_entries", "Cached replies stored (the response cache).",
                                   registry=registry)
        self.reply_bytes = Gauge("switchboard_response_cache_bytes", "Bytes of cached replies (bounded by "
                                 "--response-cache-max-bytes, LRU beyond).", registry=registry)
        self.evictions = Counter(
            "switchboard_cache_evictions_total",
            "Transcripts dropped by the node (reason ttl|lru).",
            ["reason"],
            registry=registry,
        )
        self.op_seconds = Histogram(
            "switchboard_cache_op_seconds",
            "Time to serve one cache operation.",
            ["op"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        for op, results in RESULTS.items():  # series exist at zero for dashboards and alerts
            self.op_seconds.labels(op)
            for result in results:
                self.requests.labels(op, result)
        for reason in ("ttl", "lru"):
            self.evictions.labels(reason)
        self.refusals = RefusalMetrics(registry, "cache", (*REFUSED_ROUTES, "metrics"))  # /metrics too
        self.snapshot_writes = Counter(
            "switchboard_cache_snapshot_writes_total",
            "Writes of the in-memory node's --snapshot-file by result (ok|error: a full or read-only disk).",
            ["result"],
            registry=registry,
        )
        for result in ("ok", "error"):
            self.snapshot_writes.labels(result)
        self.snapshot_failing = Gauge(
            "switchboard_cache_snapshot_failing",
            "1 while the last write of --snapshot-file failed: records changed since are in memory only.",
            registry=registry,
        )

    def snapshot_written(self, ok: bool) -> None:
        self.snapshot_writes.labels("ok" if ok else "error").inc()
        self.snapshot_failing.set(0 if ok else 1)

    def evicted(self, reason: str, count: int) -> None:
        self.evictions.labels(reason).inc(count)

    def watch(self, storage: ManagedStorage, replies: ManagedStorage) -> None:
        self.entries.set_function(lambda: storage.stats().entries)
        self.bytes.set_function(lambda: storage.stats().bytes)
        self.reply_entries.set_function(lambda: replies.stats().entries)
        self.reply_bytes.set_function(lambda: replies.stats().bytes)

    @contextlib.contextmanager
    def track(self, op: str, request: Request, node_id: str) -> Iterator[_Result]:
        """A span continuing the caller's trace, a latency sample and a result count.

        FastAPI's own telemetry may already have opened the server span from ``traceparent``;
        then ours nests under it, otherwise ours is the server span.
        """
        outcome = _Result()
        started = time.perf_counter()
        nested = trace.get_current_span().get_span_context().is_valid
        with tracer.start_as_current_span(
            f"cache_node.{op}",
            context=None if nested else propagate.extract(request.headers),
            kind=trace.SpanKind.INTERNAL if nested else trace.SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            span.set_attribute("switchboard.cache.op", op)
            span.set_attribute("switchboard.cache.node_id", node_id)
            try:
                yield outcome
            except SwitchboardError as exc:
                name_request(request, span)  # its error names this span's trace (the caller's), not one of its own
                span.set_attribute("http.response.status_code", exc.status)
                if exc.status >= 500:
                    span.set_status(trace.StatusCode.ERROR, exc.code or "")
                raise
            except Exception as exc:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
                raise
            finally:
                span.set_attribute("switchboard.cache.result", outcome.result)
                self.requests.labels(op, outcome.result).inc()
                self.op_seconds.labels(op).observe(time.perf_counter() - started)


@dataclass
class _Result:
    result: str = "error"


# -- HTTP -----------------------------------------------------------------------------------


def create_app(
    settings: CacheNodeSettings,
    storage: ManagedStorage | None = None,
    registry: CollectorRegistry | None = None,
    cluster_token: str | None = None,
) -> FastAPI:
    """The node's ASGI app; `storage` and `registry` default to what `settings` describe.
    `cluster_token`: what session and span reads and writes must present (None: open)."""
    registry = registry if registry is not None else CollectorRegistry()
    metrics = CacheNodeMetrics(registry)
    store: ManagedStorage = storage if storage is not None else build_storage(settings, metrics)
    replies = MemoryStorage(settings.response_cache_max_bytes, on_evict=metrics.evicted)
    metrics.watch(store, replies)
    node_id = settings.member_id

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await store.start()
            stack.push_async_callback(store.aclose)
            await replies.start()
            stack.push_async_callback(replies.aclose)
            await kv.store.start()
            stack.push_async_callback(kv.store.aclose)
            if settings.membership or settings.registry_url:
                await _register(settings, store, stack, kv)
            log.info("cache node %s serving on %s (backend %s)", node_id, settings.url, store.backend)
            yield

    app = FastAPI(title="Switchboard cache node", lifespan=lifespan, **fastapi_options())
    install_error_handlers(app)
    app.add_route("/metrics", guarded_metrics(metrics_endpoint(registry), cluster_token, metrics_token_from_env(),
                                              refusals=metrics.refusals))
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, cluster_token, refusals=metrics.refusals))
    def hop(route: str) -> list[Any]:  # the cluster-token check of one API, its refusals counted under its route
        return [Depends(require_cluster_token(cluster_token, f"the cache node's {REFUSED_ROUTES[route]}",
                                              metrics.refusals.on(route)))]

    if cluster_token is None:
        log.warning("no cluster token (SWITCHBOARD_CLUSTER_TOKEN): anyone who reaches this port can read and "
                    "write session records (they are sealed by the gateway, but can be deleted)")
    kv = mount_kv(app, settings, hop("kv"), node_id, registry)  # KV blocks: data_plane/cache/kv_routes.py

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await store.ready()
        body = {"status": "ok" if ready else "unavailable", "node_id": node_id, "backend": store.backend}
        return JSONResponse(body, status_code=200 if ready else 503)

    _mount_records(app, "/v1/sessions", store, settings.ttl_s, hop("sessions"), metrics, node_id, settings.max_body_bytes,
                   on_delete=kv.store.drop_session)  # a session's KV blocks go with it
    # The response cache (data_plane/gateway/response_cache.py): sealed replies, its own byte budget
    _mount_records(app, "/v1/response-cache", replies, settings.response_cache_ttl_s, hop("response_cache"), metrics, node_id,
                   settings.max_body_bytes, op_prefix="reply_")

    return app


def _mount_records(app: FastAPI, prefix: str, store: ManagedStorage, default_ttl_s: float, hop: list[Any],
                   metrics: CacheNodeMetrics, node_id: str, max_body_bytes: int, *, op_prefix: str = "",
                   on_delete: Callable[[str], Awaitable[Any]] | None = None) -> None:
    """GET/PUT/DELETE `prefix`/{id}: whole sealed records in `store` (sessions, or cached replies)."""

    @app.get(prefix + "/{session_id:path}", dependencies=hop)
    async def get_session(session_id: str, request: Request) -> JSONResponse:
        with metrics.track(op_prefix + "get", request, node_id) as op:
            validate_session_id(session_id)
            record = await store.get(session_id)
            if record is None:
                op.result = "miss"
                raise NotFound(
                    f"session {session_id!r} not found", param="session_id", code="session_not_found"
                )
            op.result = "hit"
            return JSONResponse(record.to_wire())

    @app.put(prefix + "/{session_id:path}", dependencies=hop)
    async def put_session(session_id: str, request: Request) -> JSONResponse:
        with metrics.track(op_prefix + "put", request, node_id) as op:
            validate_session_id(session_id)
            try:
                raw = await read_json_body(request, max_body_bytes)
            except PayloadTooLarge as exc:  # the limit, for the gateway to refuse a record this large before it
                exc.headers[LIMIT_HEADER] = str(max_body_bytes)  # generates one (data_plane/cache/client_values.py)
                raise
            try:
                body = PutSessionBody.model_validate(raw)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors(include_url=False)) from None
            now = time.time()
            ttl_s = body.ttl_s if body.ttl_s is not None else default_ttl_s
            record = Transcript(
                session_id=session_id,
                owner=body.owner,
                messages=tuple(m.model_dump() for m in body.messages),
                version=body.version,
                updated_at=body.updated_at if body.updated_at is not None else now,
                expires_at=now + ttl_s,
            )
            outcome = await store.put(record, ttl_s, only_newer=body.only_newer)
            if not outcome.stored:
                op.result = "stale"
                raise VersionConflict(
                    f"session {session_id!r} holds version {outcome.version} >= {body.version}",
                    param="version",
                    stored_version=outcome.version,
                )
            op.result = "stored"
            return JSONResponse(
                {
                    "session_id": session_id,
                    "version": record.version,
                    "updated_at": record.updated_at,
                    "expires_at": record.expires_at,
                }
            )

    @app.delete(prefix + "/{session_id}/if-version/{version}", dependencies=hop)
    async def delete_version(session_id: str, version: str, request: Request) -> JSONResponse:
        """The gateway's conditional delete: a path a node of before it refuses (400, an invalid id) where it
        ignored ``?if_version`` and removed whatever version it held, a write that landed since too."""
        return await delete(session_id, request, version)

    @app.delete(prefix + "/{session_id:path}", dependencies=hop)
    async def delete_session(session_id: str, request: Request) -> JSONResponse:
        return await delete(session_id, request, request.query_params.get("if_version"))

    async def delete(session_id: str, request: Request, if_version: str | None) -> JSONResponse:
        """Remove the record (`if_version`: only that copy, one moved back to its node)."""
        with metrics.track(op_prefix + "delete", request, node_id) as op:
            validate_session_id(session_id)
            if if_version is not None and not (if_version.isdigit() and int(if_version) < 2**53):
                raise InvalidRequest("if_version must be a record version", param="if_version")
            deleted = await store.delete(session_id, if_version=None if if_version is None else int(if_version))
            if on_delete is not None and if_version is None:  # a moved copy's KV blocks are not the session's end
                await on_delete(session_id)
            op.result = "hit" if deleted else "miss"
            kept = None if deleted or if_version is None else await store.get(session_id)
            return JSONResponse({"session_id": session_id, "deleted": deleted,
                                 **({"stored_version": kept.version} if kept is not None else {})})


async def _register(
    settings: CacheNodeSettings, store: ManagedStorage, stack: contextlib.AsyncExitStack, kv: KVNode
) -> None:
    """Register as service ``cache``; the stack deregisters, then closes the client, on shutdown."""
    from data_plane.membership.view import Member

    http = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
    stack.push_async_callback(http.aclose)
    meta = {"backend": store.backend, "zone": settings.zone, LIMIT_META: str(settings.max_body_bytes)}
    if store.backend == "memory":
        meta["max_bytes"] = str(settings.max_bytes)
    member = Member(id=settings.member_id, service="cache", url=settings.url, meta=meta)
    _, new_agent = membership_from_url(settings.membership or settings.registry_url or "", http, ())
    agent = new_agent(member, settings.registration_ttl_s)
    await agent.start()
    stack.push_async_callback(agent.aclose)
    announce = asyncio.create_task(announce_kv_bytes(agent, kv.store), name="cache-node-kv-announce")
    stack.push_async_callback(stop_tasks, announce)


# -- entry point ----------------------------------------------------------------------------


def parse_settings(argv: list[str] | None) -> CacheNodeSettings:
    """Flags, then ``SWITCHBOARD_CACHE_*``, then defaults (data_plane/common/settings_cli.py)."""
    return cli_settings(CacheNodeSettings, argv, prog="switchboard cache-node",
                        description=f"Run one cache node (session transcripts and KV blocks). {TOKENS_HELP}")


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_process("switchboard-cache-node")
    registry = CollectorRegistry()
    serve(create_app(settings, registry=registry, cluster_token=cluster_token_from_env()), host=settings.host,
          port=settings.port, registry=registry, process="cache")
