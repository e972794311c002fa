"""The gateway: the OpenAI-compatible chat API end users call.

    switchboard gateway --port 8000 --registry-url http://127.0.0.1:8300 --keys-file keys.yaml

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-sb-...")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...],
                                   extra_headers={"X-Session-Id": "new"})

This module builds the process (`build_gateway`: keys, tiers, safety, limits from the settings)
and its ASGI app (`GatewayApp`: the chat route served directly, everything else by FastAPI); the
lifespan opens the `Runtime` (data_plane/gateway/runtime.py) through an AsyncExitStack. One
request's path is data_plane/gateway/chat.py; its response stream is data_plane/gateway/stream.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Scope, Send

from data_plane.common.errors import ModelNotFound, Overloaded, clipped, install_error_handlers, render
from data_plane.common.hop_auth import (
    TOKENS_HELP,
    RefusalMetrics,
    cluster_token_from_env,
    guarded,
    guarded_metrics,
    metrics_token_from_env,
)
from data_plane.common.telemetry import (
    configure_process,
    fastapi_options,
    metrics_endpoint,
    recent_spans_endpoint,
)
from data_plane.completions_request import CompletionRequest
from data_plane.gateway.chat import ChatHandler
from data_plane.gateway.chat_store import StoredChatHandler, mount_chat_store
from data_plane.gateway.completions import COMPLETIONS_PATH, CompletionsHandler
from data_plane.gateway.context import TokenCounter
from data_plane.gateway.conversations import mount_conversations
from data_plane.gateway.keys_file import checked_keys, hot_keys
from data_plane.gateway.metrics import REFUSED_ROUTES
from data_plane.gateway.response_store import ConversationStore
from data_plane.gateway.responses import RESPONSES_PATH, ResponsesHandler, mount_responses
from data_plane.gateway.responses_background import BackgroundMetrics, BackgroundRuns, Detach
from data_plane.gateway.responses_compact import mount_compact
from data_plane.gateway.responses_count import mount_input_tokens
from data_plane.gateway.responses_detached import mount_background, serve_background
from data_plane.gateway.responses_socket import serve_socket
from data_plane.gateway.runtime import Gateway, Runtime, open_runtime
from data_plane.gateway.safety.pipeline import SafetyPolicies
from data_plane.gateway.settings import GatewaySettings
from data_plane.gateway.usage import usage_route
from data_plane.protocol import ChatCompletionRequest
from data_plane.routing.upstream import CHAT_PATH
from data_plane.tiers import TierPolicy

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

COMPLETIONS_OPENAPI: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/CompletionRequest"}}}}}


def build_gateway(settings: GatewaySettings, registry: CollectorRegistry | None = None) -> Gateway:
    tiers = TierPolicy.from_yaml(settings.tiers_file) if settings.tiers_file else TierPolicy.default()
    safety = SafetyPolicies.from_yaml(settings.safety_file) if settings.safety_file else SafetyPolicies.default()
    if settings.control_plane_url or settings.registry_url:  # its hot policy may name tiers ours lacks:
        keys = hot_keys(settings, lambda: tiers)  # refusing to start was a crash loop after a tier was added
    else:
        keys = checked_keys(settings, tiers)
    safety.validate_names(t.safety for t in (tiers.get(n) for n in tiers.names()))
    counter = TokenCounter.whitespace() if settings.tokenizer == "whitespace" else TokenCounter.for_model(
        settings.tokenizer)
    return Gateway(settings, keys, tiers, safety, counter, registry or CollectorRegistry())

SETTLE_S = 3.0
"""Seconds the shutdown waits for cancelled requests to record their ends (`GatewayApp.settle`)."""


def create_app(gw: Gateway) -> GatewayApp:
    holder: GatewayApp  # assigned below, before the lifespan or any route can run

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:  # closes the runtime in reverse order
            holder.runtime = await open_runtime(gw, stack)
            holder.store = ConversationStore(holder.runtime.sessions, gw.settings.session_ttl_s)
            stack.push_async_callback(holder.store.aclose)  # pending background compactions
            s = gw.settings
            holder.background = BackgroundRuns(s.background_per_tenant, s.background_max_s, s.background_keep_s,
                                               s.background_event_bytes, s.background_held, background_metrics)
            stack.push_async_callback(holder.background.aclose)  # first: runs store their end while nodes are up
            try:
                yield
                await holder.settle(SETTLE_S)
            finally:
                holder.runtime = None

    app = FastAPI(title="Switchboard gateway", version="0.1.0", lifespan=lifespan, **fastapi_options(),
                  description="OpenAI-compatible chat completions with server-side sessions.")
    install_error_handlers(app)
    background_metrics = BackgroundMetrics(gw.registry)
    refusals = RefusalMetrics(gw.registry, "gateway", REFUSED_ROUTES)  # token refusals, every route at 0
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, cluster_token_from_env(), refusals=refusals))
    scrape = metrics_endpoint(gw.registry)

    async def metrics_view(request: Request) -> Response:
        rt = holder.runtime
        if rt is not None:
            gw.metrics.membership_reachable.set(1 if getattr(rt.membership, "reachable", True) else 0)
            for service in ("shard", "cache"):
                gw.metrics.membership_members.labels(service).set(len(rt.membership.members(service)))
            rt.admission.fair_share.flush()  # the charges the publish throttle held back
        return await scrape(request)

    # its series name tenants and their token volumes, on the public chat port: Prometheus's token only
    app.add_route("/metrics", guarded_metrics(metrics_view, cluster_token_from_env(), metrics_token_from_env(),
                                              refusals=refusals))

    @app.get("/health")
    async def health() -> JSONResponse:
        rt = holder.started()
        return JSONResponse({"status": "ok", "shards": len(rt.router.shards()),
                             "membership_reachable": getattr(rt.membership, "reachable", True),
                             "control_plane_reachable": getattr(rt.cluster, "reachable", None),
                             "degradation_level": rt.cluster.current().degradation.level})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gw.caller(request)  # bans, blocked keys, throttles and a removed tier apply; 401s counted
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "switchboard", "max_model_len": ctx}
            for name, ctx in sorted(holder.started().models().items())]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        gw.caller(request)  # bans, blocked keys, throttles and a removed tier apply; 401s counted
        found = holder.started().models()
        if model_id not in found:
            raise ModelNotFound(f"the model {clipped(model_id)!r} does not exist", param="model")
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "switchboard",
                "max_model_len": found[model_id]}

    usage = usage_route(lambda r: gw.caller(r)[0], gw.ledger)
    app.add_api_route("/v1/usage", usage, methods=["GET"])
    app.add_api_route("/v1/organization/usage/completions", usage, methods=["GET"])  # the openai SDK's path
    mount_responses(app, gw, lambda: holder.conversations())
    mount_compact(app, gw, lambda: holder.conversations(), lambda: holder.started())
    mount_input_tokens(app, gw, lambda: holder.conversations(), lambda: holder.started())
    mount_background(app, gw, lambda: holder.conversations(), lambda: holder.runs())
    mount_conversations(app, gw, lambda: holder.conversations(), lambda: holder.started())
    mount_chat_store(app, gw, lambda: holder.conversations())

    @app.post(RESPONSES_PATH)
    async def responses(request: Request) -> Response:  # pragma: no cover - GatewayApp serves this path
        raise RuntimeError("POST /v1/responses is served by GatewayApp")

    @app.post(COMPLETIONS_PATH, openapi_extra=COMPLETIONS_OPENAPI)
    async def completions(request: Request) -> Response:  # pragma: no cover - GatewayApp serves this path
        raise RuntimeError("POST /v1/completions is served by GatewayApp")

    @app.post(CHAT_PATH, openapi_extra=CHAT_OPENAPI)
    async def chat(request: Request) -> Response:  # pragma: no cover - GatewayApp serves this path
        raise RuntimeError("POST /v1/chat/completions is served by GatewayApp")

    _describe_chat_body(app)
    holder = GatewayApp(gw, app)
    return holder


def _describe_chat_body(app: FastAPI) -> None:
    """/openapi.json: the chat and completions routes' bodies are read by hand (for 413/408/415 control), so their
    schemas are added here, from the same pydantic models that validate them."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
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
        self.runtime: Runtime | None = None
        self.store: ConversationStore | None = None
        self.background: BackgroundRuns | None = None
        """Set for as long as the lifespan runs (from start-up to shutdown): the one check for it is `started`."""
        self._serving: set[asyncio.Task[Any]] = set()
        """The chat and Responses requests under way (their tasks), for `settle`."""

    async def settle(self, timeout: float) -> None:
        """At shutdown, before the runtime closes: wait (up to `timeout`) for the requests uvicorn has just
        cancelled past its grace to end their streams and record their ends. The lifespan's shutdown runs
        right after the cancel, so a Responses stream that first stored its `failed` response found the
        ledger's spool folder gone ("could not spool the record": the request missing from usage)."""
        pending = {t for t in self._serving if not t.done()}
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def started(self) -> Runtime:
        """The runtime, or 503 while the process starts or stops."""
        if self.runtime is None:
            raise Overloaded("the gateway is starting or stopping", retry_after=1, code="not_ready")
        return self.runtime

    def conversations(self) -> ConversationStore:
        """Responses and conversations on this runtime's session store (503 while not started)."""
        self.started()
        assert self.store is not None
        return self.store

    def runs(self) -> BackgroundRuns:
        """This gateway's background responses (503 while not started)."""
        self.started()
        assert self.background is not None
        return self.background

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == RESPONSES_PATH:  # OpenAI's WebSocket mode
            await serve_socket(self, self.gw.caller, scope, receive, send)
            return
        path = scope["path"] if scope["type"] == "http" and scope["method"] == "POST" else ""
        if path in (CHAT_PATH, RESPONSES_PATH, COMPLETIONS_PATH):
            request = Request(scope, receive)
            try:
                runtime = self.started()
            except Overloaded as exc:
                await render(exc, request)(scope, receive, send)
                return
            handler: ChatHandler
            if path == CHAT_PATH:
                handler = StoredChatHandler(self.gw, runtime, request, self.conversations())
            elif path == COMPLETIONS_PATH:  # the legacy Completions API (data_plane/gateway/completions.py)
                handler = CompletionsHandler(self.gw, runtime, request)
            else:
                handler = ResponsesHandler(self.gw, runtime, request, self.conversations())
            task = asyncio.current_task()
            if task is not None:
                self._serving.add(task)
            try:
                await handler.serve(scope, receive, send)
            except Detach as detach:  # background: true (data_plane/gateway/responses_detached.py)
                assert isinstance(handler, ResponsesHandler)
                await serve_background(self.gw, runtime, self.conversations(), self.runs(), handler, detach.raw,
                                       scope, receive, send)
            finally:
                if task is not None:
                    self._serving.discard(task)
        else:
            await self.api(scope, receive, send)


def main(argv: list[str] | None = None) -> None:
    from data_plane.common.http_server import serve
    from data_plane.common.settings_cli import parse_settings

    settings = parse_settings(GatewaySettings, argv, prog="switchboard gateway",
                              description=f"The chat gateway. {TOKENS_HELP}")
    configure_process("switchboard-gateway")
    try:  # a keys, tier or safety file that does not parse or does not fit: one line, not a traceback
        gw = build_gateway(settings)
    except ValueError as exc:
        raise SystemExit(f"switchboard gateway: {exc}") from None
    except OSError as exc:  # --state-dir under a file, on a read-only disk, another user's folder
        raise SystemExit(f"switchboard gateway: {exc.filename or settings.state_dir}: {exc.strerror or exc}") from None
    serve(create_app(gw), host=settings.host, port=settings.port, registry=gw.registry)


if __name__ == "__main__":
    main()
