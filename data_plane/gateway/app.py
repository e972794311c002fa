"""The gateway: the OpenAI-compatible chat API end users call.

    switchboard gateway --port 8000 --registry-url http://127.0.0.1:8300 --keys-file keys.yaml

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-sb-...")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...],
                                   extra_headers={"X-Session-Id": "new"})

This module holds what one gateway process is (`Gateway`: keys, tiers, safety, limits,
membership, router, shard pool) and its ASGI app (`GatewayApp`: the chat route served directly,
everything else by FastAPI). One request's path is data_plane/gateway/chat.py; its response
stream is data_plane/gateway/stream.py.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from pydantic import AnyHttpUrl
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Scope, Send

from data_plane.gateway.admission import Admission, AdmissionConfig, AdmissionMetrics, shard_capacity
from data_plane.gateway.auth import KeyStore
from data_plane.cache.client import SessionStore
from data_plane.gateway.cluster_state import (
    ClusterState,
    ClusterStateView,
    HttpClusterState,
)
from data_plane.gateway.context import TokenCounter
from data_plane.common.errors import (
    ModelNotFound,
    install_error_handlers,
)
from data_plane.gateway.chat import ChatHandler
from data_plane.gateway.metrics import GatewayMetrics
from data_plane.gateway.settings import GatewaySettings
from data_plane.common.hop_auth import cluster_headers, cluster_token_from_env, guarded
from data_plane.routing.hop_client import HOP_EVENTS, HopPool
from data_plane.ledger.writer import UsageLedger
from data_plane.gateway.usage import ledger_from_settings, usage_route
from data_plane.membership.embedded import HttpMembership
from data_plane.membership.view import Member, MembershipView, StaticMembership
from data_plane.membership.factory import (
    AgentFactory,
    WatchedMembership,
    membership_from_url,
)
from data_plane.protocol import (
    ChatCompletionRequest,
)
from data_plane.gateway.ratelimit.limiter import (
    RateLimiter,
    RateLimitMetrics,
    build_limiter,
)
from data_plane.routing.router import Router, RouterMetrics
from data_plane.gateway.safety.pipeline import SafetyMetrics, SafetyPolicies
from data_plane.common.crypto import Keyring, SealMetrics, TranscriptSealer
from data_plane.common.tls import TlsConfig
from data_plane.common.telemetry import configure_process, fastapi_options, metrics_endpoint, recent_spans_endpoint
from data_plane.tiers import TierPolicy
from data_plane.routing.upstream import CHAT_PATH, Upstream, UpstreamConfig

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

CHAT_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/ChatCompletionRequest"}}}},
    "parameters": [
        {"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "'new' starts a server-side session; its id comes back in this header"},
    ],
}


def _static_members(urls: list[AnyHttpUrl], service: str) -> list[Member]:
    return [Member(id=f"{service}-{i}", service=service, url=str(url).rstrip("/")) for i, url in enumerate(urls)]


@dataclass
class Gateway:
    """Everything one gateway process holds; built in `create_app`, owned by the lifespan."""

    settings: GatewaySettings
    keys: KeyStore
    tiers: TierPolicy
    safety: SafetyPolicies
    counter: TokenCounter
    registry: CollectorRegistry
    metrics: GatewayMetrics = field(init=False)
    safety_metrics: SafetyMetrics = field(init=False)
    router_metrics: RouterMetrics = field(init=False)
    membership: MembershipView | None = None
    router: Router | None = None
    upstream: Upstream | None = None
    sessions: SessionStore | None = None
    http: httpx.AsyncClient | None = None
    """For cache nodes, membership and the control plane; shards are called through `pool`."""
    pool: HopPool | None = None
    cluster: ClusterStateView | None = None
    limiter: RateLimiter = field(init=False)
    admission: Admission = field(init=False)
    ledger: UsageLedger | None = None
    """One usage record per request (data_plane/ledger/writer.py); None with --usage-db off."""

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(self.registry)
        self.safety_metrics = SafetyMetrics(self.registry)
        self.router_metrics = RouterMetrics(self.registry)
        s = self.settings
        self.limiter = build_limiter(s.ratelimit_backend, RateLimitMetrics(self.registry), redis_url=s.redis_url,
                                     tier_rpm=s.tier_rpm, tier_tpm=s.tier_tpm, known_tiers=self.tiers.names())
        config = AdmissionConfig(max_inflight=s.max_inflight, inflight_per_slot=s.inflight_per_slot,
                                 reserve=s.admission_reserve, queue_size=s.queue_size, queue_timeout_s=s.queue_timeout_s,
                                 queue_timeouts=s.queue_timeouts)
        self.admission = Admission(AdmissionMetrics(self.registry), config, capacity=lambda: shard_capacity(
            [m.meta.get("max_num_seqs") for m in self.router.shards()] if self.router else [], config))

    def models(self) -> dict[str, int]:
        """Model id -> context window, from the shards' registration metadata."""
        assert self.router is not None
        found: dict[str, int] = {}
        for m in self.router.shards():
            name = m.meta.get("model") or self.settings.model_name
            ctx = int(m.meta.get("max_model_len") or self.settings.max_model_len)
            found[name] = min(found.get(name, ctx), ctx)
        return found or {self.settings.model_name: self.settings.max_model_len}


def _load_keys(settings: GatewaySettings) -> KeyStore:
    stores = []
    if settings.keys_file:
        stores.append(KeyStore.from_yaml(settings.keys_file))
    if settings.api_keys:
        stores.append(KeyStore.from_env(settings.api_keys))
    if not stores:
        raise SystemExit("switchboard gateway: no API keys configured; pass --keys-file or "
                         "SWITCHBOARD_GATEWAY_API_KEYS='key:tenant:tier' (`switchboard up` makes dev keys)")
    return KeyStore.merged(*stores)


def build_gateway(settings: GatewaySettings, registry: CollectorRegistry | None = None) -> Gateway:
    tiers = TierPolicy.from_yaml(settings.tiers_file) if settings.tiers_file else TierPolicy.default()
    safety = SafetyPolicies.from_yaml(settings.safety_file) if settings.safety_file else SafetyPolicies.default()
    keys = _load_keys(settings)
    keys.validate_tiers(tiers.names())
    safety.validate_names(t.safety for t in (tiers.get(n) for n in tiers.names()))
    counter = TokenCounter.whitespace() if settings.tokenizer == "whitespace" else TokenCounter.for_model(
        settings.tokenizer)
    return Gateway(settings, keys, tiers, safety, counter, registry or CollectorRegistry())


def create_app(gw: Gateway) -> GatewayApp:
    settings = gw.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        gw.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=settings.connect_timeout_s), limits=limits)
        watcher: WatchedMembership | None = None
        new_agent: AgentFactory | None = None
        if settings.membership or settings.registry_url:
            watcher, new_agent = membership_from_url(settings.membership or settings.registry_url or "", gw.http)
            await watcher.start()
            gw.membership = watcher
        else:
            gw.membership = StaticMembership(
                _static_members(settings.shard_urls, "shard") + _static_members(settings.cache_urls, "cache"))
        cluster: HttpClusterState | None = None
        if settings.control_plane_url or settings.registry_url:
            cluster = HttpClusterState(settings.control_plane_url or settings.registry_url or "", gw.http,
                                       validate=lambda p: gw.safety.validate_names(p[n].safety for n in p))
            await cluster.start()
            gw.cluster = cluster
        gw.router = Router(gw.membership, gw.router_metrics, policy=settings.routing_policy,
                           epsilon=settings.bounded_load_epsilon, eject_after=settings.eject_after,
                           eject_s=settings.eject_s, zone=settings.zone, zone_slack=settings.zone_spill_slack)
        hop_events = {event: gw.metrics.hop_connections.labels(event) for event in HOP_EVENTS}
        gw.pool = HopPool(connect_timeout_s=settings.connect_timeout_s,
                          on_event=lambda event: hop_events[event].inc())
        gw.upstream = Upstream(gw.router, gw.pool, UpstreamConfig(
            connect_timeout_s=settings.connect_timeout_s, first_token_timeout_s=settings.first_token_timeout_s,
            idle_timeout_s=settings.idle_timeout_s, silence_timeout_s=settings.silence_timeout_s,
            retries=settings.retries, resumes=settings.resumes))
        keys = Keyring.from_settings(keys_file=settings.session_keys_file, keys_env=settings.session_keys,
                                     cluster_token=cluster_token_from_env())
        log.info("session transcripts are encrypted at rest (AES-256-GCM, key %s, %s)", keys.current, keys.source)
        gw.sessions = SessionStore(gw.membership, gw.pool, registry=gw.registry,
                                   sealer=TranscriptSealer(keys, SealMetrics(gw.registry)),
                                   headers=cluster_headers(cluster_token_from_env()), zone=settings.zone)
        if watcher is not None:
            watcher.subscribe(gw.sessions.on_membership_change)  # a rejoining node is repaired at once
        if isinstance(watcher, HttpMembership):  # it knows every member's status, draining ones too
            known, upstream = watcher, gw.upstream
            watcher.subscribe(lambda: upstream.drop_lost({m.id: m.status for m in known.all_members("shard")}))
        gw.ledger = ledger_from_settings(settings, gw.registry)
        if gw.ledger is not None:
            await gw.ledger.start()
        agent = None
        if new_agent is not None:
            agent = new_agent(Member(
                id=settings.node_id or f"gateway-{settings.host}-{settings.port}", service="gateway",
                url=f"{TlsConfig.from_env().scheme}://{settings.host}:{settings.port}",
                meta={"zone": settings.zone}), 2.0)
            await agent.start()
        # Everything built so far lives as long as the process: move it out of the cyclic GC's
        # sight, so a full collection walks per-request garbage only (p99, not just CPU).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if agent is not None:
                await agent.aclose()
            await gw.sessions.aclose()
            if gw.ledger is not None:
                await gw.ledger.aclose()
            await gw.limiter.aclose()
            if watcher is not None:
                await watcher.aclose()
            if cluster is not None:
                await cluster.aclose()
            await gw.pool.aclose()
            await gw.http.aclose()

    app = FastAPI(title="Switchboard gateway", version="0.1.0", lifespan=lifespan, **fastapi_options(),
                  description="OpenAI-compatible chat completions with server-side sessions.")
    install_error_handlers(app)
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, cluster_token_from_env()))
    scrape = metrics_endpoint(gw.registry)

    async def metrics_view(request: Request) -> Response:
        gw.metrics.membership_reachable.set(1 if getattr(gw.membership, "reachable", True) else 0)
        if gw.membership is not None:
            for service in ("shard", "cache"):
                gw.metrics.membership_members.labels(service).set(len(gw.membership.members(service)))
        return await scrape(request)

    app.add_route("/metrics", metrics_view)

    @app.get("/health")
    async def health() -> JSONResponse:
        shards = len(gw.router.shards()) if gw.router else 0
        reachable = getattr(gw.membership, "reachable", True)
        state = gw.cluster.current() if gw.cluster is not None else ClusterState()
        return JSONResponse({"status": "ok", "shards": shards, "membership_reachable": reachable,
                             "control_plane_reachable": getattr(gw.cluster, "reachable", None),
                             "degradation_level": state.degradation.level})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gw.keys.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "switchboard", "max_model_len": ctx}
            for name, ctx in sorted(gw.models().items())]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        gw.keys.authenticate(request.headers.get("authorization"))
        found = gw.models()
        if model_id not in found:
            raise ModelNotFound(f"the model {model_id!r} does not exist", param="model")
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "switchboard",
                "max_model_len": found[model_id]}

    app.add_api_route("/v1/usage", usage_route(gw), methods=["GET"])

    @app.post(CHAT_PATH, openapi_extra=CHAT_OPENAPI)
    async def chat(request: Request) -> Response:  # pragma: no cover - GatewayApp serves this path
        raise RuntimeError("POST /v1/chat/completions is served by GatewayApp")

    _describe_chat_body(app)
    return GatewayApp(gw, app)


def _describe_chat_body(app: FastAPI) -> None:
    """/openapi.json: the chat route's body is read by hand (for 413/408/415 control), so its
    schema is added here, from the same pydantic model that validates it."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            body = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(body.pop("$defs", {}))
            components["ChatCompletionRequest"] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class GatewayApp:
    """The gateway's ASGI app. `POST /v1/chat/completions`, the hot path, is served here
    directly; everything else (models, health, metrics, docs, lifespan) by FastAPI.

    Going around FastAPI's routing and its six middleware layers, and around Starlette's
    StreamingResponse (a task group and cancel scopes per response, a send per chunk), saves
    ~1 ms of CPU per streamed completion; see `switchboard bench overhead`."""

    def __init__(self, gw: Gateway, api: FastAPI) -> None:
        self.gw = gw
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT_PATH and scope["method"] == "POST":
            await ChatHandler(self.gw, Request(scope, receive)).serve(scope, receive, send)
        else:
            await self.api(scope, receive, send)


def main(argv: list[str] | None = None) -> None:
    from data_plane.common.http_server import serve
    from data_plane.common.settings_cli import parse_settings

    settings = parse_settings(GatewaySettings, argv, prog="switchboard gateway")
    configure_process("switchboard-gateway")
    serve(create_app(build_gateway(settings)), host=settings.host, port=settings.port)


if __name__ == "__main__":
    main()
