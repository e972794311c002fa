"""The inference shard: one engine behind the OpenAI chat-completions protocol.

    switchboard shard --port 8101                       # torch engine, default model, bfloat16
    switchboard shard --port 8101 --dtype float32       # batch-invariant greedy output
    switchboard shard --model /models/qwen.gguf --registry-url http://127.0.0.1:8300

    curl -s localhost:8101/v1/chat/completions -H 'content-type: application/json' \\
         -H "Authorization: Bearer $SWITCHBOARD_CLUSTER_TOKEN" \\
         -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":32}'

With a cluster token (`SWITCHBOARD_CLUSTER_TOKEN`, as `switchboard up` starts it) generation and token
counts need it, as the gateways send it: a caller that skipped the gateway would skip its keys, rate
limits, safety filter and ledger, and could name another tenant's `cache_salt` or session. Without
one the shard runs open, as a single-machine dev shard.

Extension fields the gateway sets: `priority` (lower first), `request_id`, `deadline`
(unix seconds). `/health` answers 503 until the model is loaded, then 200. `/metrics`
uses vLLM's metric names. Every 4xx/503 is decided before the first SSE byte; after it, a
failure ends the stream with an error event and `data: [DONE]`.

The engine comes from `engine_factory.py` (by `--engine`); each request becomes the engine's requests
in `generation.py`. Started by `switchboard shard` (control_plane/cli.py), which calls `main`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.propagate import extract
from prometheus_client import CollectorRegistry

from data_plane.common.disconnect import CLIENT_CLOSED_STATUS, CLIENT_DISCONNECTED, DisconnectWatch
from data_plane.common.errors import InvalidRequest, ModelNotFound, Overloaded, SwitchboardError, install_error_handlers
from data_plane.common.hop_auth import (
    TOKENS_HELP,
    RefusalMetrics,
    cluster_headers,
    cluster_token_from_env,
    guarded,
    guarded_metrics,
    metrics_token_from_env,
    require_cluster_token,
)
from data_plane.common.http_body import read_body
from data_plane.common.http_metrics import install_http_metrics
from data_plane.common.http_server import SHUTDOWN, SHUTDOWN_CUT, serve
from data_plane.common.keepalive import KEEPALIVE_COMMENT, KEEPALIVE_HEADER, KEEPALIVE_META, with_keepalives
from data_plane.common.kv_report import SINCE_HEADER
from data_plane.common.telemetry import configure_process, fastapi_options, metrics_endpoint, recent_spans_endpoint
from data_plane.common.tls import TlsConfig
from data_plane.membership.factory import membership_from_url
from data_plane.protocol import (
    INPUT_TOKENS_PATH,
    ChatCompletionRequest,
    Openings,
    chunk_body,
    completion_body,
    new_completion_id,
    parse_chat_request,
)
from data_plane.shard.choices import Choice, choice_streams, describe, merged, prepare_requests, token_bytes
from data_plane.shard.engine_factory import build_engine
from data_plane.shard.engines.base import FINISH_STOP, Engine, GenerationOutput, GenerationRequest, KVSessionRef
from data_plane.shard.generation import generation_requests, prompt_ids
from data_plane.shard.group_exit import GroupExit
from data_plane.shard.kv_reports import KVReportMetrics, KVReports
from data_plane.shard.kv_seal import KVSealer, kv_keyring
from data_plane.shard.kv_tier import KVTier, start_kv_tier
from data_plane.shard.metrics import REFUSED_ROUTES, ShardMetrics
from data_plane.shard.replies import model_card, usage_of
from data_plane.shard.settings import ShardSettings
from data_plane.shard.stage_view import record_stage_spans, stage_meta, stage_ranges

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


class ShardState:
    def __init__(self, settings: ShardSettings, engine: Engine, metrics: ShardMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.ready = False
        self.load_error: str | None = None
        self.kv_tier: KVTier | None = None
        self.started = int(time.time())


def create_app(settings: ShardSettings, registry: CollectorRegistry | None = None) -> FastAPI:
    from data_plane.model_store import served_name

    registry = registry or CollectorRegistry()
    name = "synthetic" if settings.engine == "synthetic" else served_name(settings.model)
    metrics = ShardMetrics(registry, name)
    engine = build_engine(settings, metrics)
    state = ShardState(settings, engine, metrics)
    kv_reports = KVReports(lambda: getattr(engine, "prefix", None), on_evicted=KVReportMetrics(registry, name).counting())
    sealer = None  # keys read now, so a bad keys file fails the start, not the first turn
    if settings.kv_tier == "on" and settings.kv_seal == "on" and settings.engine == "torch":
        sealer = KVSealer(kv_keyring(keys_file=settings.kv_keys_file, keys_env=settings.kv_keys,
                                     cluster_token=cluster_token_from_env()), metrics.kv_tier)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import httpx

        http = httpx.AsyncClient(timeout=5.0)
        agent = None
        views: list[Any] = []
        # A lost pipeline stage or a dead engine: the shard leaves membership and exits at once (group_exit.py).
        group_exit = GroupExit.attach(engine, asyncio.get_running_loop(), lambda: agent.aclose() if agent else None,
                                      settings.pipeline_exit_linger_s)

        async def load() -> None:
            nonlocal agent
            try:
                await engine.start()
            except Exception as exc:  # noqa: BLE001 -- the shard stays up, unhealthy, saying why
                state.load_error = f"{type(exc).__name__}: {exc}"
                log.error("model load failed: %s", state.load_error)
                return
            state.ready = True
            metrics.ready.labels(metrics.model_name).set(1)
            if settings.membership or settings.registry_url:
                from data_plane.membership.view import Member

                url = settings.advertise_url or f"{TlsConfig.from_env().scheme}://{settings.host}:{settings.port}"
                member = Member(
                    id=settings.node_id or f"shard-{settings.host}-{settings.port}",
                    service="shard",
                    url=url,
                    meta={"model": engine.model_name, "engine": settings.engine,
                          "fingerprint": engine.system_fingerprint,
                          "max_num_seqs": str(settings.max_num_seqs), "pipeline_parallel_size": str(settings.pipeline_parallel_size),
                          "max_model_len": str(engine.max_model_len), "zone": settings.zone,
                          **stage_meta(engine, httpx.URL(url).host),
                          **({KEEPALIVE_META: f"{settings.keepalive_s:g}"} if settings.keepalive_s else {})},
                )
                view, new_agent = membership_from_url(settings.membership or settings.registry_url or "", http,
                                                      ("cache",) if settings.kv_tier == "on" else ())
                agent = new_agent(member, settings.registration_ttl_s)
                await agent.start()
                if settings.kv_tier == "on":  # KV blocks on the cache nodes: data_plane/shard/kv_tier.py
                    await view.start()
                    views.append(view)
                    state.kv_tier = start_kv_tier(
                        engine, metrics.kv_tier, view, http, zone=settings.zone,
                        headers=cluster_headers(cluster_token_from_env()), prior_mbps=settings.kv_fetch_prior_mbps,
                        prior_prefill_tok_s=settings.kv_prefill_prior_tok_s,
                        max_pending_bytes=settings.kv_offload_queue_bytes, sealer=sealer)

        loader = asyncio.create_task(load(), name="shard-model-load")
        app.state.shard = state
        app.state.leave_membership = lambda: agent.leave_now() if agent is not None else None
        try:
            yield
        finally:
            loader.cancel()
            if agent is not None:
                await agent.aclose()
            if state.kv_tier is not None:
                await state.kv_tier.aclose()
            for view in views:
                await view.aclose()
            await engine.aclose()
            await http.aclose()
            group_exit.finish()  # a lost pipeline stage: exit non-zero so the supervisor replaces the group

    app = FastAPI(title="Switchboard shard", version="0.1.0", lifespan=lifespan, **fastapi_options())
    install_error_handlers(app)
    install_http_metrics(app, registry)
    refusals = RefusalMetrics(registry, "shard", REFUSED_ROUTES)  # token refusals, every route at 0
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, cluster_token_from_env(), refusals=refusals))

    async def metrics_view(request: Request) -> Response:
        if state.ready:
            metrics.observe_engine(engine, settings.kv_block_size, settings.dtype)
        return await metrics_endpoint(registry)(request)

    app.add_route("/metrics", guarded_metrics(metrics_view, cluster_token_from_env(), metrics_token_from_env(),
                                              refusals=refusals))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        dead = getattr(engine, "dead", None)
        if dead is not None:
            return JSONResponse({"status": "failed", "error": str(dead)}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        stats = engine.stats()
        return JSONResponse({"status": "ok", "model": engine.model_name, "running": stats.running,
                             "waiting": stats.waiting, "kv_usage": stats.kv_usage})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(engine, state.started)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != engine.model_name:
            raise ModelNotFound(f"the model {model_id[:128]!r} does not exist", param="model")
        return model_card(engine, state.started)

    async def serving(request: Request) -> ChatCompletionRequest:
        """The request's body, once the model is loaded and is the one it names (503 / 404 otherwise)."""
        raw = await read_body(request, settings.max_body_bytes)
        req = parse_chat_request(raw, request.headers.get("content-type"), client=False)  # the gateway's hop
        if state.load_error:
            raise Overloaded(f"this shard has no model: {state.load_error}", retry_after=30, code="model_unavailable")
        if not state.ready:
            raise Overloaded("the model is still loading", retry_after=2, code="model_loading")
        if req.model and req.model != engine.model_name:
            raise ModelNotFound(f"the model {req.model!r} does not exist; this shard serves "
                                f"{engine.model_name!r}", param="model")
        if req.continue_final_message and req.tools and not req.stream:  # its call began in the text already sent
            raise InvalidRequest("a continued tool envelope is served streamed only (a resume)", param="stream")
        return req

    hop = [Depends(require_cluster_token(cluster_token_from_env(), "the shard's chat API", refusals.on("chat")))]

    @app.post(INPUT_TOKENS_PATH, dependencies=hop)
    async def input_tokens(request: Request) -> dict[str, Any]:
        """The prompt tokens a chat request would have (its `usage.prompt_tokens`), generating nothing:
        the Responses API's input token count (data_plane/gateway/responses_count.py)."""
        req = await serving(request)
        _, ids = prompt_ids(req, engine)
        return {"object": "chat.input_tokens", "input_tokens": len(ids)}

    @app.post("/v1/chat/completions", dependencies=hop)
    async def chat(request: Request) -> Response:
        req = await serving(request)
        ctx = extract(request.headers)
        request_id = req.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        span = tracer.start_span("shard.generate", context=ctx, attributes={
            "gen_ai.operation.name": "text_completion" if req.raw_prompt else "chat",
            "gen_ai.system": "switchboard",
            "gen_ai.request.model": engine.model_name,
            "gen_ai.request.max_tokens": req.output_limit or 0,
            "gen_ai.request.temperature": req.temperature if req.temperature is not None else 1.0,
            "switchboard.request_id": request_id,
            "switchboard.priority": req.priority or 0,
            "switchboard.stream": req.stream,
            "switchboard.pipeline_stages": settings.pipeline_parallel_size,
        })
        external_tokens = 0
        plan = req.output_plan()
        try:
            gen_reqs = generation_requests(req, engine, request_id, settings.kv_public_prefix, plan)
            gen_req = gen_reqs[0]
            describe(span, gen_reqs, plan)
            if plan.constraint is not None:
                metrics.structured.labels(metrics.model_name, plan.constraint.kind).inc()
            if req.session_id and state.kv_tier is not None:  # blocks missing here may come from the cache nodes
                gen_req.kv_session = KVSessionRef(req.session_id, req.kv_replicas or 1, req.kv_ttl_s)
                external_tokens = await state.kv_tier.prepare(gen_req, span)
            await prepare_requests(engine, gen_reqs, plan)
            outputs = merged(choice_streams(engine, gen_reqs))
        except SwitchboardError as exc:
            metrics.rejected.labels(metrics.model_name, exc.code or "error").inc()
            span.set_attribute("error.type", exc.code or "error")
            span.end()
            raise
        if settings.log_prompts:
            log.info("request %s prompt=%r", request_id, req.plain_messages())
        headers = {"X-Request-Id": request_id, **kv_reports.headers(gen_req, request.headers.get(SINCE_HEADER))}
        run = _Run(state, gen_req, span, time.monotonic(),
                   [Choice(i, plan, token_bytes(engine) if req.logprobs else None, r.resumed_text, req.stop or (),
                           r.prompt_ids[0] if r.prompt_ids else None) for i, r in enumerate(gen_reqs)])
        run.request_ids = [r.request_id for r in gen_reqs]
        run.external_tokens = external_tokens
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(run.sse(outputs, include_usage, continuous, settings.keepalive_s),
                                     media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache",
                                              **({KEEPALIVE_HEADER: f"{settings.keepalive_s:g}"}
                                                 if settings.keepalive_s else {})})
        body = await run.collect(outputs, request)
        if body is None:  # the client is gone: nothing to send
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(body, headers=headers)

    return app


class _Run:
    """One request's trip through the engine: metrics, span and wire format."""

    def __init__(self, state: ShardState, req: GenerationRequest, span: trace.Span, t0: float,
                 choices: list[Choice]) -> None:
        self.state = state
        self.req = req
        self.choices = choices
        self.finals: dict[int, GenerationOutput] = {}
        self.latest: dict[int, GenerationOutput] = {}
        """Each choice's last output (its tokens so far): what a request that ends unfinished generated."""
        self.span = span
        self.t0 = t0
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.external_tokens = 0  # prompt tokens whose KV came from the cache nodes (kv_tier.py)
        self.request_ids = [req.request_id]  # one engine request per choice

    async def _stopped(self, index: int, out: GenerationOutput) -> GenerationOutput | None:
        """`out` as choice `index`'s final output when its content just hit a stop string (under tools the
        choice applies them, choices.ContentStop): the engine's request is aborted, its later outputs
        are dropped. None when the choice goes on; the output itself when it had already ended."""
        if index in self.finals:
            return None
        choice = self.choices[index]
        if not choice.stopped or out.finish_reason is not None:
            return out
        await self.state.engine.abort(self.request_ids[index])
        return dataclasses.replace(out, finish_reason=FINISH_STOP)

    def _finish(self, last: GenerationOutput | None, error: str | None = None) -> None:
        span = self.span
        if last is not None and len(self.finals) < len(self.choices):  # aborted or failed: every choice's tokens
            last = dataclasses.replace(last, completion_tokens=sum(o.completion_tokens for o in self.latest.values()))
        if last is not None:
            self.state.metrics.observe_finished(last, time.monotonic() - self.t0, self.external_tokens,
                                                self.req.params.max_tokens)
            reason = last.finish_reason or "abort"
            span.set_attribute("gen_ai.usage.cache_read_input_tokens", last.cached_tokens)
            span.add_event("prefix_cache", {"tokens_cached": last.cached_tokens,
                                            "tokens_computed": last.prompt_tokens - last.cached_tokens})
            if last.cached_tokens:
                log.debug("request %s: %d of %d prompt tokens from the prefix cache", self.req.request_id,
                          last.cached_tokens, last.prompt_tokens)
            if last.spec_drafts:
                span.add_event("speculation", {"drafts": last.spec_drafts, "draft_tokens": last.spec_draft_tokens,
                                               "accepted_tokens": last.spec_accepted_tokens})
                log.debug("request %s: %d drafts, %d of %d draft tokens accepted", self.req.request_id,
                          last.spec_drafts, last.spec_accepted_tokens, last.spec_draft_tokens)
            span.set_attribute("gen_ai.usage.input_tokens", last.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", last.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [reason])
            record_stage_spans(tracer, span, last.stages, stage_ranges(self.state.engine))
            if last.timings:
                t = last.timings
                if self.state.kv_tier is not None:  # learns this shard's prefill speed (fetch-or-recompute)
                    self.state.kv_tier.observe_prefill(last.prompt_tokens - last.cached_tokens, t.prefill_s)
                span.add_event("queue", {"duration_s": t.queued_s})
                span.add_event("prefill", {"duration_s": t.prefill_s})
                span.add_event("decode", {"duration_s": t.decode_s})
        elif error == CLIENT_DISCONNECTED:
            self.state.metrics.observe_left_early()
        if error:
            span.set_attribute("error.type", error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end()

    def _cancelled(self, what: str) -> str:
        """Why a running request was cancelled: its client left, or this shard's shutdown outlived its grace."""
        if not SHUTDOWN.past_grace():
            return CLIENT_DISCONNECTED
        self.state.metrics.shutdown_cuts.inc()  # one line, not uvicorn's traceback (data_plane/common/http_server.py)
        log.info("request %s: %s cut by shutdown after the grace; the gateway resumes it", self.req.request_id, what)
        return SHUTDOWN_CUT

    def _final(self, index: int, out: GenerationOutput) -> GenerationOutput | None:
        """Record choice `index`'s final output; once every choice ended, the request's (usage summed)."""
        self.finals[index] = out
        if len(self.finals) < len(self.choices):
            return None
        first = self.finals[0]
        return dataclasses.replace(first, completion_tokens=sum(o.completion_tokens for o in self.finals.values()))

    async def collect(self, outputs: AsyncIterator[tuple[int, GenerationOutput]],
                      request: Request) -> dict[str, Any] | None:
        """The whole completion as one body; None when the client left first (the engine's
        generator is closed by the cancellation: it aborts at its next step)."""
        last: GenerationOutput | None = None
        watch = DisconnectWatch(request.receive)
        watch.start()
        try:
            async for index, out in outputs:
                self.choices[index].feed(out)
                if (kept := await self._stopped(index, out)) is None:
                    continue
                out = self.latest[index] = kept
                last = (self._final(index, out) if out.finish_reason is not None else None) or out
        except asyncio.CancelledError:
            self._finish(last, CLIENT_DISCONNECTED if (left := watch.swallow()) else self._cancelled("request"))
            if not left:  # the server is shutting down
                raise
            log.info("request %s: client disconnected, aborted", self.req.request_id)
            return None
        except SwitchboardError as exc:
            self._finish(last, exc.code)
            raise
        finally:
            watch.stop()
        assert last is not None and len(self.finals) == len(self.choices)
        self._finish(last)
        usage = usage_of(last)
        body = completion_body(completion_id=self.completion_id, model=self.state.engine.model_name, text="",
                               finish_reason=None, usage=usage, created=self.created,
                               fingerprint=self.state.engine.system_fingerprint)
        body["choices"] = [{"index": c.index, "message": {**c.message(), "refusal": None},
                            "logprobs": c.wire_logprobs(),
                            "finish_reason": c.finish(self.finals[c.index].finish_reason)} for c in self.choices]
        return body

    async def sse(self, outputs: AsyncIterator[tuple[int, GenerationOutput]], include_usage: bool,
                  continuous_usage: bool = False, keepalive_s: float = 0.0) -> AsyncIterator[bytes]:
        model = self.state.engine.model_name
        last: GenerationOutput | None = None

        def event(body: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

        common: dict[str, Any] = {"completion_id": self.completion_id, "model": model, "created": self.created,
                                  "include_usage": include_usage,
                                  "fingerprint": self.state.engine.system_fingerprint}
        error = None
        openings = Openings()  # which choices were opened (their role sent), in index order
        try:
            stream = with_keepalives(outputs, keepalive_s) if keepalive_s else outputs
            async for item in stream:
                if item is None:  # nothing from the engine for keepalive_s: tell the gateway we are alive
                    yield KEEPALIVE_COMMENT
                    continue
                index, out = item
                choice = self.choices[index]
                so_far = usage_of(out) if continuous_usage else None
                for delta in choice.feed(out):
                    logprobs = delta.pop("logprobs", None)
                    *opening, (_, delta) = openings.deltas(index, delta)
                    for i, d in opening:
                        yield event(chunk_body(**common, delta=d, usage=so_far, index=i))
                    yield event(chunk_body(**common, delta=delta, usage=so_far, index=index, logprobs=logprobs))
                if (kept := await self._stopped(index, out)) is None:
                    continue
                last = out = self.latest[index] = kept
                if out.finish_reason is not None:
                    for i, d in openings.ending(index):  # nothing was released: the choice still opens
                        yield event(chunk_body(**common, delta=d, index=i))
                    yield event(chunk_body(**common, delta={}, finish_reason=choice.finish(out.finish_reason),
                                           index=index))
                    done = self._final(index, out)
                    if done is not None:
                        last = done
                        if include_usage:
                            yield event(chunk_body(**common, usage=usage_of(done), empty_choices=True))
        except SwitchboardError as exc:
            error = exc.code or "error"
            yield event(exc.body(self.req.request_id))
        except asyncio.CancelledError:
            if (error := self._cancelled("stream")) == CLIENT_DISCONNECTED:
                log.info("request %s: client disconnected mid-stream, aborted", self.req.request_id)
            raise  # past the grace too: the connection is cut, so the gateway sees the break and resumes
        finally:
            self._finish(last, error)
        yield b"data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    from data_plane.common.settings_cli import parse_settings

    settings = parse_settings(ShardSettings, argv, prog="switchboard shard",
                              description=f"An inference shard. {TOKENS_HELP}")
    configure_process("switchboard-shard")
    if settings.engine == "vllm":
        from data_plane.shard.engines.vllm_engine import run_sidecar  # lazy: vllm is a GPU-only extra

        run_sidecar(settings)
        return
    registry = CollectorRegistry()
    app = create_app(settings, registry)  # SIGTERM: out of membership at once, running streams get the grace
    serve(app, host=settings.host, port=settings.port, registry=registry, process="shard",
          on_shutdown=lambda: getattr(app.state, "leave_membership", lambda: None)())


if __name__ == "__main__":
    main()
