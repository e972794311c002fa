"""The gateway: the OpenAI-compatible chat API end users call.

    switchboard gateway --port 8000 --registry-url http://127.0.0.1:8300 --keys-file keys.yaml

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-sb-...")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...],
                                   extra_headers={"X-Session-Id": "new"})

Per request, in order (each a span under `gateway.request`): authenticate the key -> tier;
read and validate the body (413/415/400); enforce the tier's output cap and message count;
`ratelimit` takes one request and the estimated tokens from the key's and tier's RPM/TPM
(429 + Retry-After; `x-ratelimit-*` headers from here on; settled with real usage at the end,
data_plane/ratelimit.py); `safety.input`; with a session, `cache.get_context` and the sliding
window (the model's tokenizer counts); `admission.queue` waits for an in-flight slot in tier
order (503 when shed, data_plane/admission.py); `router.route` opens a supervised stream on a shard (retrying once
elsewhere before the first token); `safety.output` over the stream with a hold-back window;
`cache.append` saves the turn before the reply completes. Every error is decided before the
first byte when it can be; after that, the stream ends with an error event and `[DONE]`.

Sessions: `X-Session-Id: <id>` (or body `session_id`) continues a conversation kept on the
cache nodes; `X-Session-Id: new` starts one with an unguessable id, returned in the
`X-Session-Id` response header. A session belongs to the key that created it; other keys
get 404.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from data_plane.admission import Admission, AdmissionConfig, AdmissionMetrics, Ticket, shard_capacity
from data_plane.auth import KeyStore, Principal, key_digest
from data_plane.cache_client import SessionStore, validate_session_id
from data_plane.cluster_state import (
    DEGRADED_HEADER,
    SPAN_ATTRIBUTE,
    ClusterState,
    ClusterStateView,
    Effects,
    HttpClusterState,
)
from data_plane.context import TokenCounter, fit_window
from data_plane.errors import (
    InvalidRequest,
    ModelNotFound,
    NotFound,
    SwitchboardError,
    install_error_handlers,
    render,
)
from data_plane.gateway_metrics import GatewayMetrics
from data_plane.gateway_settings import GatewaySettings
from data_plane.gateway_stream import CLIENT_CLOSED_STATUS, Completion
from data_plane.membership import Member, MembershipView, StaticMembership
from data_plane.membership_factory import (
    AgentFactory,
    WatchedMembership,
    membership_from_url,
)
from data_plane.protocol import (
    ChatCompletionRequest,
    parse_chat_request,
    read_body,
)
from data_plane.ratelimit import (
    Grant,
    RateLimiter,
    RateLimitMetrics,
    build_limiter,
    parse_tier_map,
)
from data_plane.router import Router, RouterMetrics
from data_plane.safety import SafetyMetrics, SafetyPolicies, raise_if_blocked
from data_plane.shard_client import ShardPool
from data_plane.telemetry import configure_process, fastapi_options, metrics_endpoint, recent_spans_endpoint
from data_plane.tiers import Tier, TierPolicy
from data_plane.upstream import CHAT_PATH, ResumableStream, Upstream, UpstreamConfig

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

NEW_SESSION = "new"
DEFAULT_REPLY_RESERVE = 256
"""Reply tokens reserved when a request sets no max_tokens."""
TEMPLATE_SLACK_TOKENS = 32
"""Headroom for chat-template tokens the per-message count cannot see (e.g. a default system
prompt the template inserts), so the shard never refuses what the gateway admitted."""


CHAT_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/ChatCompletionRequest"}}}},
    "parameters": [
        {"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "'new' starts a server-side session; its id comes back in this header"},
    ],
}


def _static_members(urls: str | None, service: str) -> list[Member]:
    out = []
    for i, url in enumerate(u.strip() for u in (urls or "").split(",") if u.strip()):
        out.append(Member(id=f"{service}-{i}", service=service, url=url.rstrip("/")))
    return out


@dataclass
class Opened:
    """A request that passed every check, with its shard stream's first token in hand."""

    stream: ResumableStream
    completion: Completion
    headers: dict[str, str]
    include_usage: bool | None
    """None: answer with one JSON body; else stream SSE (with a usage chunk when True)."""


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
    pool: ShardPool | None = None
    cluster: ClusterStateView | None = None
    limiter: RateLimiter = field(init=False)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(self.registry)
        self.safety_metrics = SafetyMetrics(self.registry)
        self.router_metrics = RouterMetrics(self.registry)
        s = self.settings
        self.limiter = build_limiter(s.ratelimit_backend, RateLimitMetrics(self.registry), redis_url=s.redis_url,
                                     tier_rpm=parse_tier_map(s.tier_rpm, "--tier-rpm"),
                                     tier_tpm=parse_tier_map(s.tier_tpm, "--tier-tpm"), known_tiers=self.tiers.names())
        config = AdmissionConfig(max_inflight=s.max_inflight, inflight_per_slot=s.inflight_per_slot,
                                 reserve=s.admission_reserve, queue_size=s.queue_size, queue_timeout_s=s.queue_timeout_s,
                                 queue_timeouts=parse_tier_map(s.queue_timeouts, "--queue-timeouts", float))
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
                           eject_s=settings.eject_s)
        gw.pool = ShardPool(connect_timeout_s=settings.connect_timeout_s)
        gw.upstream = Upstream(gw.router, gw.pool, UpstreamConfig(
            connect_timeout_s=settings.connect_timeout_s, first_token_timeout_s=settings.first_token_timeout_s,
            idle_timeout_s=settings.idle_timeout_s, retries=settings.retries, resumes=settings.resumes))
        gw.sessions = SessionStore(gw.membership, gw.http, registry=gw.registry)
        agent = None
        if new_agent is not None:
            agent = new_agent(Member(
                id=settings.node_id or f"gateway-{settings.host}-{settings.port}", service="gateway",
                url=f"http://{settings.host}:{settings.port}"), 2.0)
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
    app.add_route("/debug/spans", recent_spans_endpoint)
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


class ChatHandler:
    """One chat request through the gateway."""

    def __init__(self, gw: Gateway, request: Request) -> None:
        self.gw = gw
        self.request = request
        self.t0 = time.monotonic()
        # Always our own id: it keys the request in the engine, so a client-chosen one could collide
        # (and a collision must never look like a shard failure). The client's id is kept on the span.
        self.request_id = uuid.uuid4().hex
        client_id = request.headers.get("x-request-id") or ""
        self.client_request_id = client_id[:128] if client_id.isprintable() else ""
        request.state.request_id = self.request_id
        self.tier_name = "unknown"
        self.tier: Tier | None = None
        self.principal: Principal | None = None
        self.session_id: str | None = None
        self.session_version = 0
        self.history: list[dict[str, str]] = []
        self.new_messages: list[dict[str, str]] = []
        self.span: trace.Span | None = None
        self.first_token_at: float | None = None
        self.grant: Grant | None = None
        self.ticket: Ticket | None = None
        self.used_tokens: int | None = None
        self.client_gone = False
        self._recorded = False
        self._receive: Receive | None = None
        self._watcher: asyncio.Future[Any] | None = None
        # the level and tier policy are read once, so one request sees one consistent state
        state = gw.cluster.current() if gw.cluster is not None else ClusterState()
        self.tiers = state.tiers or gw.tiers
        self.effects = Effects(state.degradation)

    # -- the request, before any byte goes out ------------------------------------------------

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the request on `send`: an error, one JSON body or an SSE stream."""
        parent = extract(self.request.headers)
        span = tracer.start_span("gateway.request", context=parent, attributes={
            "gen_ai.operation.name": "chat", "switchboard.request_id": self.request_id,
            "switchboard.client_request_id": self.client_request_id, SPAN_ATTRIBUTE: self.effects.level})
        self.span = span
        self._receive = receive
        token = otel_context.attach(trace.set_span_in_context(span))
        streaming = False
        try:
            try:
                opened = await self._prepare_and_open()
                if opened.include_usage is not None:
                    streaming = True
                    headers = self._headers(opened.headers, {"content-type": "text/event-stream; charset=utf-8",
                                                             "cache-control": "no-cache"})
                    await opened.completion.stream_to(send, opened.stream, opened.include_usage, headers)
                    return
                try:
                    body = await opened.completion.collect(opened.stream)
                finally:
                    self.gw.metrics.inflight.labels(self.tier_name).dec()
                self._record(200, "ok")
                response: Response = self._degraded(JSONResponse(body, headers=opened.headers))
            except SwitchboardError as exc:
                self._record(exc.status, exc.code or "error")
                span.set_attribute("error.type", exc.code or "error")
                span.set_status(trace.Status(trace.StatusCode.ERROR, exc.code or "error"))
                self.request.state.trace_id = format(span.get_span_context().trace_id, "032x")
                if self.grant is not None:
                    exc.headers = {**self.grant.headers, **exc.headers}
                response = self._degraded(render(exc, self.request))
            except ClientDisconnect:
                raise
            except Exception:
                log.exception("request %s: unhandled error", self.request_id)
                self._record(500, "internal_error")
                span.set_status(trace.Status(trace.StatusCode.ERROR, "internal_error"))
                response = render(SwitchboardError("internal server error"), self.request)
            self.stop_watching()
            await response(scope, receive, send)
        except ClientDisconnect:  # gone while sending its body
            self._client_left(span)
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            # The client left: the cancellation was ours (see _watch_disconnect), not the server's.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self._client_left(span)
        finally:
            self.stop_watching()
            otel_context.detach(token)
            if not streaming:
                self._release_limits()
                span.end()

    def _client_left(self, span: trace.Span) -> None:
        span.set_attribute("error.type", "client_disconnected")
        log.info("request %s: client disconnected; generation aborted", self.request_id)
        self._record(CLIENT_CLOSED_STATUS, "client_disconnected")

    def _watch_disconnect(self) -> None:
        """Once the body is read, the next ASGI `receive` only returns when the client goes away
        (or the response is complete): then the request's task is cancelled, which aborts
        whatever it waits on (admission queue, shard, stream) and the shard's work with it."""
        task = asyncio.current_task()
        if task is None or self._watcher is not None or self._receive is None:
            return

        def on_message(watcher: asyncio.Future[Any]) -> None:
            if watcher.cancelled() or watcher.exception() is not None or self._watcher is None:
                return
            if watcher.result().get("type") == "http.disconnect":
                self.client_gone = True
                task.cancel()

        self._watcher = asyncio.ensure_future(self._receive())
        self._watcher.add_done_callback(on_message)

    def stop_watching(self) -> None:
        """Before the last write: the response completing must not look like a disconnect."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()

    def _headers(self, base: dict[str, str], extra: dict[str, str]) -> list[tuple[bytes, bytes]]:
        headers = {**base, **extra}
        if self.effects.level > 0:
            headers[DEGRADED_HEADER] = str(self.effects.level)
        return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    def _degraded(self, response: Response) -> Response:
        """Tell the client the service is degraded (every chat response while the level is > 0)."""
        if self.effects.level > 0:
            response.headers[DEGRADED_HEADER] = str(self.effects.level)
        return response

    def _record(self, status: int, code: str) -> None:
        if self._recorded:
            return
        self._recorded = True
        self.gw.metrics.requests.labels(self.tier_name, str(status), code).inc()

    def _release_limits(self) -> None:
        """Free the admission slot; settle the token estimate: all refunded if no shard started,
        real usage once known, kept if the stream broke before usage came (idempotent)."""
        if self.ticket is not None:
            self.ticket.release()
        if self.grant is not None:
            used = self.used_tokens if self.used_tokens is not None else (None if self.first_token_at else 0)
            if used is not None:
                self.gw.limiter.settle_later(self.grant, used)

    async def _prepare_and_open(self) -> Opened:
        gw, settings, span = self.gw, self.gw.settings, self.span
        assert span is not None
        principal = gw.keys.authenticate(self.request.headers.get("authorization"))
        self.principal = principal
        tiers = self.tiers if principal.tier in self.tiers else gw.tiers  # a key's tier the hot policy lacks
        tier = tiers.get(principal.tier)
        self.tier, self.tier_name = tier, tier.name
        span.set_attribute("switchboard.tier", tier.name)
        self.effects.admit(tier, tiers)
        raw = await read_body(self.request, settings.max_body_bytes)
        self._watch_disconnect()
        req = parse_chat_request(raw, self.request.headers.get("content-type"))
        models = gw.models()
        model = req.model or next(iter(models))
        if model not in models:
            raise ModelNotFound(f"the model {req.model!r} does not exist", param="model")
        span.set_attribute("gen_ai.request.model", model)
        if len(req.messages) > settings.max_messages:
            raise InvalidRequest(f"at most {settings.max_messages} messages are allowed per request",
                                 param="messages")
        max_tokens = req.output_limit or tier.max_output_tokens
        if max_tokens > tier.max_output_tokens:
            raise InvalidRequest(f"max_tokens is {max_tokens}, above the {tier.name} tier's cap of "
                                 f"{tier.max_output_tokens}", param="max_tokens")
        max_tokens = self.effects.max_tokens(max_tokens)
        messages = req.plain_messages()
        self.new_messages = messages
        # Session history is not known yet: settlement charges it with the rest of the real usage.
        self.grant = await gw.limiter.admit(principal.key_id, tier, gw.counter.prompt_tokens(messages) + max_tokens)
        policy = gw.safety.get(tier.safety)
        with tracer.start_as_current_span("safety.input"):
            verdict = policy.check_input(m["content"] for m in messages if m["role"] in ("user", "system"))
            gw.safety_metrics.record("input", verdict)
            raise_if_blocked(verdict)

        prompt = messages
        session_header = self.request.headers.get("x-session-id") or req.session_id
        if session_header:
            prompt = await self._load_session(session_header, messages, tier)
        context = min(tier.max_context_tokens, models[model])
        # Without max_tokens, reserve a modest reply while fitting the window, then let the reply
        # use the room the prompt leaves, up to the tier's cap (as vLLM does).
        reserve = max_tokens if req.output_limit else min(max_tokens, DEFAULT_REPLY_RESERVE, context // 2)
        budget = context - reserve - TEMPLATE_SLACK_TOKENS
        if budget <= 0:
            raise InvalidRequest(f"max_tokens {max_tokens} leaves no room for the prompt in a "
                                 f"{context}-token context", param="max_tokens", code="context_length_exceeded")
        window = fit_window(prompt, gw.counter, self.effects.prompt_budget(budget, context))
        if not req.output_limit:
            max_tokens = max(1, min(max_tokens, context - window.prompt_tokens - TEMPLATE_SLACK_TOKENS))
        if window.dropped:
            gw.metrics.context_dropped.labels(tier.name).inc(window.dropped)
        span.set_attribute("switchboard.context.dropped_messages", window.dropped)
        if settings.log_prompts:
            log.info("request %s prompt=%r", self.request_id, window.messages)

        body: dict[str, Any] = {
            "messages": window.messages, "max_tokens": max_tokens, "stream": True,
            "priority": tier.priority,
            "request_id": self.request_id, "deadline": time.time() + settings.first_token_timeout_s * 5,
        }
        for name in ("temperature", "top_p", "top_k", "stop", "seed"):
            value = getattr(req, name)
            if value is not None:
                body[name] = value
        if req.model:
            body["model"] = model
        self.ticket = await gw.admission.acquire(tier, tiers)
        gw.metrics.inflight.labels(tier.name).inc()
        try:
            with tracer.start_as_current_span("router.route") as route_span:
                assert gw.upstream is not None
                stream = await gw.upstream.open_resumable(body, self.session_id)
                route_span.set_attribute("switchboard.shard", stream.member.id)
                route_span.set_attribute("switchboard.attempts", stream.attempts)
        except BaseException:
            gw.metrics.inflight.labels(tier.name).dec()
            raise
        self.first_token_at = time.monotonic()
        gw.metrics.ttft.labels(tier.name).observe(self.first_token_at - self.t0)
        completion = Completion(self, model, policy.output_stream())
        headers = {"X-Request-Id": self.request_id, **(self.grant.headers if self.grant else {})}
        if self.session_id:
            headers["X-Session-Id"] = self.session_id
        include_usage = bool(req.stream_options and req.stream_options.include_usage) if req.stream else None
        return Opened(stream, completion, headers, include_usage)

    async def _load_session(self, header: str, messages: list[dict[str, str]], tier: Tier) -> list[dict[str, str]]:
        gw = self.gw
        assert self.principal is not None and gw.sessions is not None
        if header == NEW_SESSION:
            self.session_id = "sess_" + secrets.token_urlsafe(24)
        else:
            self.session_id = validate_session_id(header)
        assert self.span is not None
        self.span.set_attribute("switchboard.session", True)
        transcript = None
        if header != NEW_SESSION:
            transcript = await gw.sessions.load(self.session_id, self.owner, tier.replication)
        if transcript is None and header != NEW_SESSION:
            # Ids are minted by the gateway (unguessable), so an unknown one expired, was lost with
            # its cache replicas, or never existed: say so rather than silently starting over.
            gw.metrics.sessions.labels(tier.name, "not_found").inc()
            raise NotFound(f"session {self.session_id!r} not found: it expired, was lost, or never existed; "
                           "start a new conversation with 'X-Session-Id: new'", param="session_id",
                           code="session_not_found")
        if transcript is None:
            gw.metrics.sessions.labels(tier.name, "new").inc()
            return messages
        gw.metrics.sessions.labels(tier.name, "resumed").inc()
        self.session_version = transcript.version
        self.history = [dict(m) for m in transcript.messages]
        if any(m["role"] == "system" for m in messages):
            history = [m for m in self.history if m["role"] != "system"]
        else:
            history = self.history
        system = [m for m in messages if m["role"] == "system"]
        rest = [m for m in messages if m["role"] != "system"]
        return system + history + rest

    @property
    def owner(self) -> str:
        """Sessions are bound to the key itself (its full SHA-256), not just to the tenant."""
        auth = self.request.headers.get("authorization") or ""
        return key_digest(auth.partition(" ")[2].strip())

    async def save_turn(self, reply: str) -> None:
        if not self.session_id or self.tier is None or self.gw.sessions is None:
            return
        if any(m["role"] == "system" for m in self.new_messages):
            base = [m for m in self.history if m["role"] != "system"]
            system = [m for m in self.new_messages if m["role"] == "system"]
            rest = [m for m in self.new_messages if m["role"] != "system"]
            transcript = system + base + rest
        else:
            transcript = self.history + self.new_messages
        transcript = transcript + [{"role": "assistant", "content": reply}]
        await self.gw.sessions.save(self.session_id, self.owner, transcript, self.session_version + 1,
                                    self.tier.replication, ttl_s=self.gw.settings.session_ttl_s)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from data_plane.settings_cli import parse_settings

    settings = parse_settings(GatewaySettings, argv, prog="switchboard gateway")
    configure_process("switchboard-gateway")
    gw = build_gateway(settings)
    from data_plane.http_server import GuardedHttpProtocol

    uvicorn.run(create_app(gw), host=settings.host, port=settings.port, log_level="warning", http=GuardedHttpProtocol,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
