"""One chat request through the gateway: `ChatHandler` (see data_plane/gateway/app.py for the app).

Per request, five phases, each a method returning a frozen value the next ones read
(data_plane/gateway/phases.py): `_authenticate` -> Caller, `_validate` -> Checked, `_budget` (the rate limit,
input safety) -> Checked (its default output cap fitted to the TPM) and the safety policy, `_prepare` -> Prepared,
`_route` -> the reply's stream. In order (each a span under `gateway.request`): authenticate the key -> tier;
read and validate the body (413/415/400); enforce the tier's output cap and message count;
`ratelimit` takes one request and the estimated tokens from the key's and tier's RPM/TPM
(429 + Retry-After; `x-ratelimit-*` headers from here on; settled with real usage at the end,
data_plane/gateway/ratelimit/limiter.py); `safety.input`; with a session, `cache.get_context` and the sliding
window (the model's tokenizer counts); `admission.queue` waits for an in-flight slot in tier
order (503 when shed, data_plane/gateway/admission.py); `router.route` opens a supervised stream on a shard
(retrying once elsewhere before the first token); `safety.output` over the stream with a hold-back
window; `cache.append` saves the turn before the reply completes. Every error is decided before
the first byte when it can be; after that, the stream ends with an error event and `[DONE]`.
Once the body is read, a client that goes away cancels the request (and so the shard's work).
The request's Exchange ends it with one frozen Outcome (data_plane/common/outcome.py) that the usage
ledger writes.

Sessions: `X-Session-Id: <id>` (or body `session_id`) continues a conversation kept on the
cache nodes; `X-Session-Id: new` starts one with an unguessable id, returned in the
`X-Session-Id` response header. A session belongs to the key that created it; other keys
get 404.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from data_plane.cache.model import validate_session_id
from data_plane.common.disconnect import DisconnectWatch
from data_plane.common.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, NotFound, as_error, render
from data_plane.common.http_body import read_body
from data_plane.common.outcome import OK, Outcome
from data_plane.gateway.auth import Principal, key_digest
from data_plane.gateway.cluster_state import DEGRADED_HEADER, SPAN_ATTRIBUTE, Effects
from data_plane.gateway.context import TEMPLATE_SLACK_TOKENS, Window, fit_window, prompt_room, trim_step
from data_plane.gateway.exchange import Exchange
from data_plane.gateway.phases import (
    DEADLINE_FIRST_TOKEN_TIMEOUTS,
    Caller,
    Checked,
    Opened,
    Prepared,
    keep_first_turn,
    merge_history,
    shard_request,
)
from data_plane.gateway.record_locks import ITEM_EDIT_WAIT_S, lost_race, record_key
from data_plane.gateway.response_cache import CachedReply, Decision, ReplayStream, cache_key, cache_policy
from data_plane.gateway.response_store import META_ROLE
from data_plane.gateway.revocation import RevocableSource, Stage
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.gateway.safety.pipeline import SafetyPolicy, raise_if_blocked
from data_plane.gateway.stream import Completion, EventSource
from data_plane.gateway.tool_results import check_answered, check_session_answered
from data_plane.legacy_functions import legacy_terms
from data_plane.protocol import ChatCompletionRequest, UsageChunks, parse_chat_request
from data_plane.structured import json_word_clash
from data_plane.tiers import Tier

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

NEW_SESSION = "new"


class ChatHandler:
    """One chat request through the gateway: `gw` (what the settings describe) and `rt` (what the
    lifespan opened, data_plane/gateway/runtime.py); its holdings live in `self.x` (an Exchange).

    Other OpenAI APIs served over this same path (the Responses API, data_plane/gateway/responses.py)
    subclass it and override the hooks: `parse` (their body -> a chat request), `context` (the
    conversation the new messages continue), `respond_body` / `respond_stream` (the reply's shape)
    and `save_turn` (what is kept afterwards)."""

    OPERATION = "chat"
    """gen_ai.operation.name on the request's span."""

    def __init__(self, gw: Gateway, rt: Runtime, request: Request) -> None:
        self.gw, self.rt, self.request = gw, rt, request
        t0 = time.monotonic()
        # Always our own id: it keys the request in the engine, so a client-chosen one could collide
        # (and a collision must never look like a shard failure). The client's id is kept on the span.
        self.request_id = uuid.uuid4().hex
        client_id = request.headers.get("x-request-id") or ""
        self.client_request_id = client_id[:128] if client_id.isprintable() else ""
        request.state.request_id = self.request_id
        self.tier: Tier | None = None
        self.principal: Principal | None = None
        self.session_version = 0
        self.history: list[dict[str, str]] = []
        self.new_messages: list[dict[str, str]] = []
        self.history_messages = 0
        """Messages of a request's body that replay stored history (the Responses API's), not new ones."""
        self.cache_header: str | None = None
        """X-Cache: HIT | MISS | BYPASS (opted out); absent when the request may not be cached."""
        self.cache_key: str | None = None
        """Set when this request's reply goes into the response cache once complete."""
        self.opened: Opened | None = None
        """Set once a stream is open (the reply's hooks read the completion from it)."""
        self.held: list[str] = []
        """Conversations / sessions this request writes, locked until its turn is saved (`hold`, `let_go`)."""
        # the level and tier policy are read once, so one request sees one consistent state
        state = rt.cluster.current()
        self.tiers = state.tiers or gw.tiers
        self.effects = Effects(state.degradation)
        span = tracer.start_span("gateway.request", context=extract(request.headers), attributes={
            "gen_ai.operation.name": self.OPERATION, "switchboard.request_id": self.request_id,
            "switchboard.client_request_id": self.client_request_id, SPAN_ATTRIBUTE: self.effects.level})
        self.x = Exchange(gw.metrics, gw.limiter, span, self.request_id, DisconnectWatch(request.receive),
                          on_record=self._record, t0=t0, level=self.effects.level)
        """Slot, grant, in-flight gauge, metrics record and span, released once by `x.close`. Once
        the body is read, a client that goes away cancels this request's task (`x.disconnect`), and
        so whatever it waits on: admission queue, shard, stream, and the shard's work with it."""

    @property
    def session_id(self) -> str | None:
        """The conversation this request continues (an X-Session-Id, or a Responses API chain)."""
        return self.x.session_id

    @session_id.setter
    def session_id(self, value: str | None) -> None:
        self.x.session_id = value

    def _record(self, outcome: Outcome) -> None:
        if self.gw.ledger is not None:
            self.gw.ledger.record_request(outcome)
        self.recorded(outcome.status)

    def recorded(self, status: int) -> None:
        """The request ended with `status` (counted by the APIs served over this path)."""

    # -- the request, before any byte goes out ------------------------------------------------

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the request on `send`: an error, one JSON body or an SSE stream."""
        x, span = self.x, self.x.span
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            try:
                opened = self.opened = await self._prepare_and_open()
                if opened.include_usage is not None:
                    headers = self._headers(opened.headers, {"content-type": "text/event-stream; charset=utf-8",
                                                             "cache-control": "no-cache"})
                    await self.respond_stream(opened, send, headers)
                    return
                body = await self.respond_body(opened)
                x.close(200, OK)
                response: Response = self._degraded(JSONResponse(body, headers=opened.headers))
            except ClientDisconnect:
                raise
            except Exception as exc:  # noqa: BLE001 -- a bug: still a 500 with the ids
                error = as_error(exc, f"request {self.request_id}")
                span.set_attribute("error.type", error.code or "error")
                span.set_status(trace.Status(trace.StatusCode.ERROR, error.code or "error"))
                self.request.state.trace_id = x.trace_id
                if x.grant is not None:  # else shed by the ladder or held by abuse before the limiter: a peek, no quota
                    error.headers = {**x.grant.headers, **error.headers}
                elif error.status in (429, 503) and self.principal is not None and self.tier is not None:
                    error.headers = {**await self.gw.limiter.peek(self.principal.key_id, self.tier), **error.headers}
                x.close(error.status, error.code or "error")
                response = self._degraded(render(error, self.request))
            x.disconnect.stop()
            await response(scope, receive, send)
        except ClientDisconnect:  # gone while sending its body
            self._client_left()
        except asyncio.CancelledError:
            if not x.disconnect.swallow():  # not the client leaving: the server's own
                raise
            self._client_left()
        finally:
            x.disconnect.stop()
            otel_context.detach(token)
            x.close(None)  # a no-op unless the server cancelled the request
            self.let_go()
            await keep_first_turn(self)  # a new session's id went out, its first turn unsaved

    async def hold(self, record_id: str, param: str) -> None:
        """Lock the stored conversation this request will rewrite until its turn is saved or the request ends
        (its client gone: the next turn waits for the end): meanwhile a second request on it is a 400
        ``conversation_locked``, not a lost turn (data_plane/gateway/record_locks.py). Keyed by owner too."""
        key = record_key(self.owner, record_id)
        await self.gw.record_locks.acquire(key, wait_s=ITEM_EDIT_WAIT_S, param=param, generation=True)
        self.held.append(key)
        self.x.disconnect.on_gone.append(lambda: self.gw.record_locks.winding_down(key))

    def let_go(self) -> None:
        """Release what `hold` took: once the turn is saved, before the reply's last bytes, so a client
        that sends its next turn the moment it reads the end of this one is not refused."""
        for key in self.held:
            self.gw.record_locks.release(key)
        self.held.clear()

    async def respond_stream(self, opened: Opened, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Stream the reply as SSE onto `send` (the Exchange is closed before the last write)."""
        assert opened.include_usage is not None
        await opened.completion.stream_to(send, opened.stream, opened.include_usage, headers)

    async def respond_body(self, opened: Opened) -> dict[str, Any]:
        """The whole reply as one JSON body."""
        return await opened.completion.collect(opened.stream)

    async def parse(self, raw: bytes) -> ChatCompletionRequest:
        """The request body as a chat request (4xx SwitchboardError when it is not one; JSON mode asked
        without saying "json", as OpenAI refuses it, unless the session's transcript may say it)."""
        session = self.request.headers.get("x-session-id")
        req = parse_chat_request(raw, self.request.headers.get("content-type"), session)
        if session and req.session_id and session != req.session_id:  # which was meant? a new one loses the other
            raise InvalidRequest("X-Session-Id and the body's session_id name different sessions", param="session_id")
        check_answered(req.messages)  # the gateway's alone: a shard's resume continues an unanswered call
        clash = json_word_clash(req.response_format, (m.text() for m in req.messages))
        if clash is not None and (session or req.session_id or NEW_SESSION) == NEW_SESSION:
            raise InvalidRequest(clash.message, param=clash.param)
        return req

    async def context(self, req: ChatCompletionRequest, messages: list[dict[str, str]],
                      tier: Tier) -> list[dict[str, str]]:
        """The prompt: `messages` after the conversation they continue (an X-Session-Id session)."""
        session_header = self.request.headers.get("x-session-id") or req.session_id
        if session_header:
            prompt = await self._load_session(session_header, messages, tier)
            if not req.functions:  # a deprecated function_call need not be answered: data_plane/legacy_functions.py
                check_session_answered(self.history, req.messages)
            return prompt
        return messages

    async def _cached(self, req: ChatCompletionRequest, body: dict[str, Any], prompt: list[dict[str, str]],
                      tenant: str) -> ReplayStream | None:
        """A cached reply for this exact request of this tenant, when it may be cached and is
        (data_plane/gateway/response_cache.py); sets `cache_key` when the reply should be stored."""
        cache = self.rt.replies
        if cache is None:
            return None
        uncacheable = bool(req.tools) or (req.n or 1) > 1 or bool(req.logprobs)
        policy = cache_policy(req.temperature, req.seed, uncacheable, req.cache, self.request.headers)
        key = cache_key(tenant, body, prompt)
        self.cache_key = key if policy.write else None
        if not policy.read:
            assert policy.decision is not None
            cache.count(self.OPERATION, policy.decision)
            self.cache_header = "BYPASS" if policy.decision is Decision.BYPASS else None
            return None
        with tracer.start_as_current_span("cache.response_get") as span:
            t0 = time.perf_counter()
            reply = await cache.get(key, tenant, self.OPERATION)
            span.set_attribute("switchboard.response_cache.hit", reply is not None)
            self.x.span.set_attribute("switchboard.response_cache.lookup_ms", (time.perf_counter() - t0) * 1000)
        self.x.span.set_attribute("switchboard.response_cache", "hit" if reply else "miss")
        self.cache_header = "HIT" if reply is not None else "MISS"
        if reply is None:
            return None
        self.cache_key = None  # nothing new to store
        return ReplayStream(reply)

    async def _completed(self, reply: str) -> None:
        """The reply is complete: keep the turn, and the reply in the response cache (off the path)."""
        await self.save_turn(reply)
        opened, cache = self.opened, self.rt.replies
        if self.cache_key is None or opened is None or cache is None or self.principal is None:
            return
        c = opened.completion
        if c.finish_reason in ("stop", "length") and c.usage.completion_tokens:
            cache.put_later(self.cache_key, self.principal.tenant, CachedReply(
                reply, c.finish_reason, c.usage.prompt_tokens, c.usage.completion_tokens, c.fingerprint))

    def field(self, name: str, req: ChatCompletionRequest) -> str:
        """Chat field `name` as this request's body spells it, for an error's `param` (the output
        limit may have come as max_completion_tokens; the Responses API renames it and messages)."""
        spelt = name == "max_tokens" and req.max_tokens is None and req.max_completion_tokens is not None
        return "max_completion_tokens" if spelt else name

    def fit(self, prompt: list[dict[str, str]], budget: int, step: int) -> Window:
        """The prompt fitted into `budget` tokens (the sliding window: oldest turns out first, `step`
        tokens at a time, data_plane/gateway/context.py)."""
        return fit_window(prompt, self.gw.counter, budget, step)

    def _fit_degraded(self, prompt: list[dict[str, str]], budget: int, context: int, step: int,
                      most: int) -> Window:
        """The window under the degradation level in force. Level 1's half-size window is there to drop
        older turns (less prefill under load), never to refuse a request: a newest message (or a
        Responses input with truncation disabled) that needs more than the half but fits the model's own
        context is fitted into the full `budget` instead. A 400 context_length_exceeded for a transient
        level would be wrong twice: it names a limit the request is within, and clients do not retry it.
        So is the reply's reserve when the request set no output limit: then `most` (the prompt's room
        beside a one-token reply) is tried last, and the reply gets what is left, as OpenAI and vLLM serve it."""
        tries = sorted({self.effects.prompt_budget(budget, context), budget, most})
        for tried in tries[:-1]:
            try:
                return self.fit(prompt, tried, step)
            except ContextLengthExceeded:
                pass
        return self.fit(prompt, tries[-1], step)

    def _client_left(self) -> None:
        code = self.x.close_gone()  # "client disconnected", or why the server stopped a background run
        log.info("request %s: %s; generation aborted", self.request_id, code.replace("_", " "))

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

    async def _prepare_and_open(self) -> Opened:
        """The request's phases, in order; each returns what the next ones read (data_plane/gateway/phases.py)."""
        caller = self._authenticate()
        hold = self.x.hold = self.gw.inflight.hold(self.owner, self.request_id)  # revocation.py: its key revoked
        with hold.interruptible(Stage.OPENING):
            checked = await self._validate(caller)
            checked, policy = await self._budget(caller, checked)
            prepared = await self._prepare(caller, checked)
            with legacy_terms(checked.req):  # a shard's 400 names the deprecated fields the body gave
                stream = await self._route(caller, checked, prepared)
        return self._opened(checked, policy, RevocableSource(stream, hold))

    def _authenticate(self) -> Caller:
        """The key (a banned address: its bad keys 403, its valid ones served), its tier, its abuse measures."""
        gw, x = self.gw, self.x
        principal = self.principal = gw.guard.authenticate(gw.keys, self.request, x.span)
        x.key_id, x.tenant = principal.key_id, principal.tenant
        tiers = self.tiers
        tier = gw.tier_gate.tier(principal, tiers)  # a tier removed from the hot policy: 403 tier_removed
        self.tier, x.tier_name = tier, tier.name
        x.span.set_attribute("switchboard.tier", tier.name)
        self.effects.admit(tier, tiers)
        return Caller(principal, tier, tiers, gw.guard.admit(principal))  # abuse: 429 when blocked or throttled

    async def _validate(self, caller: Caller) -> Checked:
        """The body read and parsed (413/415/400), the model known, the message count and output cap kept."""
        gw, settings, span, tier = self.gw, self.gw.settings, self.x.span, caller.tier
        raw = await read_body(self.request, settings.max_body_bytes)
        self.x.disconnect.start()
        req = await self.parse(raw)
        models = self.rt.models()
        model = req.model or next(iter(models))
        if model not in models:
            raise ModelNotFound(f"the model {req.model!r} does not exist", param="model")
        span.set_attribute("gen_ai.request.model", model)
        if len(req.messages) - self.history_messages > settings.max_messages:
            raise InvalidRequest(f"at most {settings.max_messages} messages are allowed per request",
                                 param=self.field("messages", req))
        max_tokens = req.output_limit or tier.max_output_tokens
        if max_tokens > tier.max_output_tokens:
            field = self.field("max_tokens", req)
            raise InvalidRequest(f"{field} is {max_tokens}, above the {tier.name} tier's cap of "
                                 f"{tier.max_output_tokens}", param=field)
        messages = self.new_messages = req.plain_messages(tools_prompt=False)  # the shard adds the tools' prompt
        plan = req.output_plan()
        self.x.output_kind = plan.constraint.kind if plan.constraint is not None else "text"
        span.set_attribute("switchboard.structured.kind", self.x.output_kind)
        span.set_attribute("switchboard.tools.mode", plan.tool_mode.value)
        tools_tokens = gw.counter.prompt_tokens([{"role": "system", "content": plan.tools_prompt}]) \
            if plan.tools_prompt else 0
        return Checked(req, model, models[model], caller.measures.max_tokens(self.effects.max_tokens(max_tokens)),
                       messages, tools_tokens)

    async def _budget(self, caller: Caller, checked: Checked) -> tuple[Checked, SafetyPolicy]:
        """The default output cap fitted to the TPM; the grant for the estimated tokens (429); the input screened (400)."""
        gw = self.gw
        # Session history is not known yet (settled with real usage); no prompt passes the context window whole
        await gw.counter.warm(checked.messages)  # long texts counted off the event loop
        prompt = min(gw.counter.prompt_tokens(checked.messages), caller.tier.max_context_tokens, checked.model_context)
        checked = checked.within_tpm(gw.limiter.token_allowance(caller.tier), prompt)
        estimate = prompt + checked.tools_tokens + checked.max_tokens * checked.choices
        self.x.grant = await gw.limiter.admit(caller.principal.key_id, caller.tier, estimate, checked.output_hint)
        policy = gw.safety.get(caller.measures.safety(caller.tier.safety, gw.safety.names()))
        with tracer.start_as_current_span("safety.input"):
            verdict = policy.check_input(m["content"] for m in checked.messages if m["role"] in ("user", "system"))
            gw.safety_metrics.record("input", verdict)
            raise_if_blocked(verdict)
        return checked, policy

    async def _prepare(self, caller: Caller, checked: Checked) -> Prepared:
        """The prompt with its conversation, fitted into the context (sliding window); the one request a shard gets."""
        gw, settings, tier, req = self.gw, self.gw.settings, caller.tier, checked.req
        prompt = await self.context(req, checked.messages, tier)
        await gw.counter.warm(prompt)  # the history's long texts too
        context = min(tier.max_context_tokens, checked.model_context)
        # Without max_tokens, reserve a modest reply while fitting the window, then let the reply
        # use the room the prompt leaves, up to the tier's cap (as vLLM does).
        max_tokens, tools_tokens = checked.max_tokens, checked.tools_tokens
        budget, most = prompt_room(context, max_tokens, bool(req.output_limit), tools_tokens,
                                   self.field("max_tokens", req), gw.counter.slack)
        # The step comes from the context, never from max_tokens: a step that varied would move the cut.
        step = trim_step(context, settings.context_trim_step)
        try:
            window = self._fit_degraded(prompt, budget, context, step, most)
        except ContextLengthExceeded as exc:  # named as the body spells it
            raise ContextLengthExceeded(exc.message, param=self.field(exc.param or "messages", req)) from None
        if not req.output_limit:
            max_tokens = max(1, min(max_tokens, context - window.prompt_tokens - tools_tokens - TEMPLATE_SLACK_TOKENS))
        if window.dropped:
            gw.metrics.context_dropped.labels(tier.name).inc(window.dropped)
            gw.metrics.context_slides.labels(tier.name, "moved" if window.cut_moved else "kept").inc()
        self.x.dropped_context(window.dropped)
        self.x.span.set_attribute("switchboard.context.cut_moved", window.cut_moved)
        if settings.log_prompts:
            log.info("request %s prompt=%r", self.request_id, window.messages)
        deadline = time.time() + settings.first_token_timeout_s * DEADLINE_FIRST_TOKEN_TIMEOUTS
        request = shard_request(checked, caller, window, max_tokens, request_id=self.request_id, deadline=deadline,
                                session_id=self.session_id, kv_ttl_s=settings.session_ttl_s)
        return Prepared(prompt, window, max_tokens, request)

    async def _route(self, caller: Caller, checked: Checked, prepared: Prepared) -> EventSource:
        """The reply's source: the response cache's, or an in-flight slot (admission, 503 when shed) and a
        shard stream with its first token in hand (retried once elsewhere before it)."""
        rt, x, window, tier = self.rt, self.x, prepared.window, caller.tier
        tenant = caller.principal.tenant
        stream: EventSource | None = await self._cached(checked.req, prepared.request.wire(), prepared.prompt, tenant)
        if stream is None:
            tokens = window.prompt_tokens + checked.tools_tokens + prepared.max_tokens * checked.choices
            x.admitted(await rt.admission.acquire(tier, caller.tiers, tenant=tenant, tokens=tokens, slots=checked.choices))
            shard = await rt.upstream.open_resumable(prepared.request, self.session_id)  # its router.route span
            rt.router.observe_kv(self.session_id, shard.member.id, window.prompt_tokens)  # kv_aware routing
            stream = shard
        x.first_token_at = time.monotonic()  # from the shard; the client's TTFT is observed in Completion
        return stream

    def _opened(self, checked: Checked, policy: SafetyPolicy, stream: EventSource) -> Opened:
        x, req = self.x, checked.req
        x.model, x.shard = checked.model, stream.member.id
        completion = Completion(x, checked.model, policy.output_stream, self.gw.safety_metrics, self._completed,
                                logprobs=bool(req.logprobs), legacy=bool(req.functions))
        headers = x.headers()
        if self.cache_header:
            headers["X-Cache"] = self.cache_header
        if self.session_id:
            headers["X-Session-Id"] = self.session_id
        include_usage = (req.stream_options.usage_chunks() if req.stream_options else UsageChunks.NONE) if req.stream else None
        return Opened(stream, completion, headers, include_usage)

    async def _load_session(self, header: str, messages: list[dict[str, str]], tier: Tier) -> list[dict[str, str]]:
        gw, sessions = self.gw, self.rt.sessions
        assert self.principal is not None
        self.x.span.set_attribute("switchboard.session", True)
        if header == NEW_SESSION:  # no cache node to keep it on: 503 now, not after the reply (its id already sent)
            self.session_id = "sess_" + secrets.token_urlsafe(24)
            sessions.replicas_for(self.session_id, tier.replication)
            transcript = None
        else:
            self.session_id = validate_session_id(header)
            await self.hold(self.session_id, "session_id")
            try:
                transcript = await sessions.load(self.session_id, self.owner, tier.replication, expected=True)
            except NotFound:  # another key's: the same 404 as a missing one, or its words say the id exists
                transcript = None
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
        if any(m["role"] == META_ROLE for m in transcript.messages):  # a Responses API record
            raise NotFound(f"session {self.session_id!r} is a Responses API conversation: continue it with "
                           "previous_response_id or conversation", param="session_id", code="session_not_found")
        gw.metrics.sessions.labels(tier.name, "resumed").inc()
        self.session_version = transcript.version
        self.history = [dict(m) for m in transcript.messages]
        return merge_history(self.history, messages)

    @property
    def owner(self) -> str:
        """Sessions are bound to the key itself (its full SHA-256), not just to the tenant."""
        auth = self.request.headers.get("authorization") or ""
        return key_digest(auth.partition(" ")[2].strip())

    async def save_turn(self, reply: str) -> None:
        if not self.session_id or self.tier is None:
            return
        transcript = merge_history(self.history, self.new_messages) + [{"role": "assistant", "content": reply}]
        with lost_race("session_id"):  # another gateway's turn on this version came first: a 400, not a lost turn
            await self.rt.sessions.save(self.session_id, self.owner, transcript, self.session_version + 1,
                                        self.tier.replication, ttl_s=self.gw.settings.session_ttl_s, only_newer=True)
        self.session_version += 1
        self.let_go()
