"""OpenAI's Responses API on the chat request path: `POST /v1/responses` and the stored responses.

    client.responses.create(model=..., input="Hi", instructions="Be brief")
    client.responses.create(model=..., input="And then?", previous_response_id=r.id)
    client.responses.create(model=..., input="Hi", conversation=conv.id)
    client.responses.retrieve(r.id); client.responses.input_items.list(r.id); client.responses.delete(r.id)

`ResponsesHandler` is the chat handler (data_plane/gateway/chat.py) with its hooks overridden: the
body is translated into a chat request (data_plane/gateway/responses_items.py), the conversation it
continues is loaded from the conversation store (data_plane/gateway/response_store.py: a previous
response's chain or a conversation, kept as sealed, replicated, key-bound sessions), the reply is
shaped as a Response object or its streaming events (data_plane/gateway/responses_stream.py), and
the turn is stored (unless `store: false`). Authentication, limits, admission, safety, KV-aware
routing, resumable streams, usage and the ledger are the chat path's own. `truncation: "disabled"`
(OpenAI's default) answers 400 when the conversation no longer fits the window; `"auto"` drops the
oldest turns and re-injects the most relevant of them (data_plane/gateway/memory.py).

A streamed response that ends without its reply is still stored (OpenAI keeps it too), as the stream
last told the client: status ``failed`` with an ``error`` ({code, message}) when the generation failed
after ``response.created`` (every shard gone past the resumes, an upstream error), or ``incomplete``
with ``incomplete_details.reason: "client_disconnected"`` (Switchboard's reason) when the client left
(the gateway then aborts the generation, as OpenAI does for a stream that is not background); its
output is what the client got so far. Such a turn is not added to a conversation, and a
`previous_response_id` naming it continues from its input (without the unfinished output): retrying
the turn is then one request. A response that fails before any event (an HTTP error) is not stored:
the client never learnt its id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from opentelemetry import trace
from starlette.types import Send

from data_plane.cache.model import TOMBSTONE_VERSION, VersionConflict
from data_plane.common.disconnect import CLIENT_DISCONNECTED
from data_plane.common.errors import ContextLengthExceeded, InvalidRequest, SwitchboardError
from data_plane.common.tasks import stop_tasks
from data_plane.gateway.auth import key_digest
from data_plane.gateway.chat import ChatHandler, Opened
from data_plane.gateway.context import Window
from data_plane.gateway.item_index import Home, fresh_items, index_items, resolve_references
from data_plane.gateway.item_pages import page
from data_plane.gateway.memory import fit_turn, open_compaction
from data_plane.gateway.response_store import ConversationStore, Kind, Record
from data_plane.gateway.responses_background import Detach
from data_plane.gateway.responses_compaction import compact_record, conversation_tokens, unsealer
from data_plane.gateway.responses_input import input_items, new_id, refuse_duplicates
from data_plane.gateway.responses_items import (
    ResponsesRequest,
    check_include,
    in_responses_terms,
    output_items,
    parse_responses_request,
    response_object,
    response_usage,
)
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.responses_stream import ResponseEvents, call_item_id
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.protocol import ChatCompletionRequest
from data_plane.structured import json_word_clash
from data_plane.tiers import Tier

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

RESPONSES_PATH = "/v1/responses"
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}
RESPONSE_ERROR_CODES = ("server_error", "rate_limit_exceeded", "invalid_prompt", "invalid_grammar")
"""The codes a failed response's error names (OpenAI's ResponseError's, and `invalid_grammar`: a schema with no whole
output is the client's error, as its 400 says); any other is named server_error (the stream's ``error`` event keeps it)."""
STREAM_DEADLINE_GRACE_S = 60.0
"""Past --background-max-s (or that long, if shorter: a background record's grace), how much longer a streamed
response stored ``in_progress`` may stay so before a reader calls it failed (its gateway is gone)."""
RESPONSES_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                    "messages": "input"}


class ResponsesHandler(ChatHandler):
    """One `POST /v1/responses` through the chat path (see the module docstring)."""

    OPERATION = "responses"

    def __init__(self, gw: Gateway, rt: Runtime, request: Request, store: ConversationStore) -> None:
        super().__init__(gw, rt, request)
        self.store = store
        self.created_at = time.time()
        self.response_id = new_id("resp")
        self.message_id = new_id("msg")
        self.rreq: ResponsesRequest | None = None
        self.new_items: list[dict[str, Any]] = []
        self.history_items: list[dict[str, Any]] = []
        self.history_bytes = 0
        """The UTF-8 length of the record the history was loaded from (the size check's bound)."""
        self.conversation: Record | None = None
        self.route = self.response_id
        self.instructions = 0
        self.response: dict[str, Any] | None = None
        self.unfinished: dict[str, Any] | None = None
        """The response of a stream that ended without its reply (failed, or the client left)."""
        self.announced = 0
        """Events sent before the stream began (a background run's, once it was accepted)."""
        self.stored_version = 0
        """The version of this response's record stored so far (its ``in_progress`` one, while it streams)."""
        self.record_lock = asyncio.Lock()
        """Held by each write of this response's record while it streams: a renewal never lands after its end."""
        self.record_final = False
        """Its end is stored (or being stored): no renewal may write ``in_progress`` again."""
        self.memory: list[dict[str, str]] = []
        """Earlier turns held by compaction items of this conversation: recall's candidates."""
        self.x.span.set_attribute("switchboard.response_id", self.response_id)

    def recorded(self, status: int) -> None:
        self.gw.responses_metrics.count(Op.CREATE, status)

    def field(self, name: str, req: ChatCompletionRequest) -> str:
        """The Responses body's name for a chat field an error names (max_output_tokens, input)."""
        return RESPONSES_FIELDS.get(name, name)

    def _open_compaction(self, encrypted: str) -> str:
        """A compaction item's summary (what the model sees); its turns join `memory`."""
        turns, summary = open_compaction(encrypted, unsealer(self.rt, self.owner))
        self.memory += turns
        return summary

    # -- the request -----------------------------------------------------------------------------

    async def _prepare_and_open(self) -> Opened:
        """The chat path's phases; an error any of them (or the shard, before the first token) raises names
        the Responses body's field: a json_schema the shard's grammar refuses is `text.format`, not
        `response_format`."""
        try:
            return await super()._prepare_and_open()
        except SwitchboardError as exc:
            raise in_responses_terms(exc) from None

    async def parse(self, raw: bytes) -> ChatCompletionRequest:
        """The chat request of the whole conversation: instructions, the stored history, the new input
        (so a function_call_output answers a call the history holds, as the chat path checks)."""
        rreq = self.rreq = parse_responses_request(raw, self.request.headers.get("content-type"))
        if rreq.background:
            self.go_background(rreq, raw)
        self.new_items = input_items(rreq.input)
        if not self.new_items:
            raise InvalidRequest("input is required", param="input")
        assert self.tier is not None
        await self._load_history(rreq, self.tier)
        self.new_items = await resolve_references(self.store, self.new_items, self.owner, self.tier.replication,
                                                  local=self.history_items)
        refuse_duplicates(self.new_items, "input", self.history_items)
        self._check_fits(rreq)
        req, self.history_messages = rreq.turn_request(self.history_items, self.new_items, self._open_compaction)
        clash = json_word_clash(req.response_format, (m.text() for m in req.messages[bool(rreq.instructions):]), True)
        if clash is not None:  # the input's messages must say "json" (the instructions do not count)
            raise InvalidRequest(clash.message, param=clash.param)
        return req

    def _check_fits(self, rreq: ResponsesRequest) -> None:
        """The records this turn rewrites (its conversation, its stored response), with its input and before its
        reply: one a cache node is known to refuse is the 400 now, not after a whole generation."""
        assert self.tier is not None
        items = self.history_items + self.new_items
        rough = self.history_bytes + len(json.dumps(self.new_items, ensure_ascii=False).encode())
        if self.conversation is not None:
            self.store.check_fits(replace(self.conversation, items=items), self.owner, self.tier.replication, rough)
        if rreq.store is not False:
            self.store.check_fits(Record(self.response_id, Kind.RESPONSE, items, self.route), self.owner,
                                  self.tier.replication, rough)

    def go_background(self, rreq: ResponsesRequest, raw: bytes) -> None:
        """``background: true``: hand the request to the app, which runs it apart from this connection
        (data_plane/gateway/responses_background.py); it needs ``store`` (400 otherwise, as OpenAI's)."""
        if rreq.store is False:
            raise InvalidRequest("background responses must be stored: set store to true (the default)",
                                 param="store")
        raise Detach(raw)

    async def context(self, req: ChatCompletionRequest, messages: list[dict[str, str]],
                      tier: Tier) -> list[dict[str, str]]:
        return messages  # the history is in the request already (parse)

    async def _load_history(self, rreq: ResponsesRequest, tier: Tier) -> None:
        conv_id = rreq.conversation_id
        if rreq.previous_response_id:
            previous = await self.store.previous(rreq.previous_response_id, self.owner, tier.replication)
            self.history_items, self.route, self.history_bytes = previous.items, previous.route, previous.stored_bytes
        elif conv_id:
            await self.hold(conv_id, "conversation")
            self.conversation = await self.store.load(conv_id, self.owner, tier.replication, Kind.CONVERSATION)
            self.history_items, self.route = self.conversation.items, self.conversation.route
            self.history_bytes = self.conversation.stored_bytes
        if self.history_items or rreq.store is not False or self.conversation is not None:
            # the chain's session: kv_aware routing and the KV blocks kept on its cache nodes
            self.session_id = self.route
        self.x.span.set_attribute("switchboard.responses.history_items", len(self.history_items))

    def fit(self, prompt: list[dict[str, str]], budget: int, step: int) -> Window:
        try:
            return self._fit(prompt, budget, step)
        except ContextLengthExceeded:
            rreq = self.rreq
            assert rreq is not None
            # instructions that do not fit on their own: no input (and no truncation) could help
            own = self.gw.counter.prompt_tokens([{"role": "system", "content": rreq.instructions or ""}])
            if rreq.instructions and own > budget:
                raise ContextLengthExceeded(f"the instructions are {own} tokens, over the {budget} this request "
                                            "leaves for input; shorten them", param="instructions") from None
            raise

    def _fit(self, prompt: list[dict[str, str]], budget: int, step: int) -> Window:
        rreq = self.rreq
        assert rreq is not None
        window, found = fit_turn(prompt, self.memory, self.gw.counter, budget, step, rreq.truncation,
                                 rreq.context_recall)
        if found is None:
            return window
        metrics = self.gw.memory_metrics
        metrics.recalls.labels("recalled" if found.message else "nothing_relevant").inc()
        metrics.recalled_tokens.inc(found.tokens)
        self.x.span.add_event("context.recall", {"switchboard.recall.candidates": found.candidates,
                                                 "switchboard.recall.turns": found.turns,
                                                 "switchboard.recall.tokens": found.tokens})
        log.info("request %s: %d earlier turn(s) out of the window, %d recalled (%d tokens)", self.request_id,
                 found.candidates, found.turns, found.tokens)
        return window

    # -- the reply -------------------------------------------------------------------------------

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  incomplete: str | None = None) -> dict[str, Any]:
        assert self.rreq is not None
        model = self.opened.completion.model if self.opened is not None else self.rreq.model
        return response_object(self.response_id, self.rreq, model, status=status, output=output, usage=usage,
                               created_at=self.created_at, incomplete=incomplete, items=self.new_items)

    def _final(self, finish_reason: str | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        if self.response is not None:
            return self.response
        assert self.opened is not None
        incomplete = INCOMPLETE_REASONS.get(finish_reason or "")
        return self._response("incomplete" if incomplete else "completed", output,
                              response_usage(self.opened.completion.usage.wire()), incomplete)

    async def respond_body(self, opened: Opened) -> dict[str, Any]:
        try:  # a shard's 400 after the first token (a schema with no whole output) names the Responses field too
            body = await opened.completion.collect(opened.stream)
        except SwitchboardError as exc:
            raise in_responses_terms(exc) from None
        if self.response is not None:
            return self.response
        choice = body["choices"][0]
        return self._final(choice.get("finish_reason"),
                           output_items(choice["message"], logprobs=(choice.get("logprobs") or {}).get("content")))

    async def respond_stream(self, opened: Opened, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        opened.completion.on_failure = self._save_unfinished
        await self._store_in_progress()
        events = ResponseEvents(send, start=lambda: self._response("in_progress", [], None),
                                finish=self._final, fail=self._unfinished, message_id=self.message_id,
                                announced=self.announced)
        renewal = asyncio.get_running_loop().create_task(self._renew_in_progress()) if self.stored_version else None
        try:
            await opened.completion.stream_to(events.send, opened.stream, True, headers)
        finally:
            await stop_tasks(renewal)

    def _deadline_span(self) -> float:
        max_s = self.gw.settings.background_max_s
        return max_s + min(STREAM_DEADLINE_GRACE_S, max_s)

    async def _renew_in_progress(self) -> None:
        """While the stream runs, its ``in_progress`` record's deadline is moved on every half span: a stream that
        outlived it (a long generation, a slow client) was stored failed by the next reader while it still
        streamed (retrieve said failed, and counted a 500). Only a dead gateway's record now expires."""
        assert self.tier is not None
        while True:
            await asyncio.sleep(self._deadline_span() / 2)
            async with self.record_lock:
                if self.record_final:
                    return
                record = self._response_record(self.history_items + self.new_items,
                                               self._response("in_progress", [], None),
                                               time.time() + self._deadline_span())
                try:
                    await self.store.save(record, self.owner, self.tier.replication)
                except VersionConflict as exc:
                    if exc.stored_version >= TOMBSTONE_VERSION:
                        return  # deleted while it streams: the delete stands
                    record.version = exc.stored_version  # a reader's write: the next renewal goes over it
                except SwitchboardError as exc:
                    log.info("request %s: in-progress deadline not renewed (%s)", self.request_id, exc.code)
                    continue
                self.stored_version = record.version

    async def _store_in_progress(self) -> None:
        """A stored streamed response is retrievable from its ``response.created`` on, ``in_progress`` (OpenAI's; it
        was a 404 until the end), with a deadline past which a reader calls it failed (its gateway died mid-stream,
        responses_background.py `expired`). Best effort: the end is stored as ever."""
        rreq = self.rreq
        assert rreq is not None and self.tier is not None
        if rreq.store is False:
            return
        deadline = time.time() + self._deadline_span()
        record = self._response_record(self.history_items + self.new_items, self._response("in_progress", [], None), deadline)
        try:
            await self.store.save(record, self.owner, self.tier.replication)
        except SwitchboardError as exc:
            log.info("request %s: in-progress response not stored (%s)", self.request_id, exc.code)
            return
        self.stored_version = record.version

    def _response_record(self, items: list[dict[str, Any]], response: dict[str, Any], deadline: float = 0.0) -> Record:
        """This response's record: `items` (the chain so far, its input in place), the next version of it."""
        start = len(self.history_items)
        return Record(self.response_id, Kind.RESPONSE, items, self.route, self.stored_version, response=response,
                      input_range=(start, start + len(self.new_items)), deadline=deadline)

    async def _save_response(self, record: Record) -> bool:
        """Store the response's final record; False when it was deleted meanwhile (while it streamed: the delete
        stands, and the stream ends as it would have). A newer version that is not a delete is a reader's
        ``failed`` (the stream outlived its ``in_progress`` record's deadline, responses_detached.py `current`):
        the stream's end is what the client got, so it is written over it (it raised, and a reply the client had
        whole stayed stored failed)."""
        assert self.tier is not None
        async with self.record_lock:
            self.record_final = True
            record.version = max(record.version, self.stored_version)
            return await self._save_final(record)

    async def _save_final(self, record: Record) -> bool:
        assert self.tier is not None
        for _ in range(3):
            try:
                await self.store.save(record, self.owner, self.tier.replication)
                return True
            except VersionConflict as exc:
                if not self.stored_version:
                    raise
                if exc.stored_version >= TOMBSTONE_VERSION:
                    log.info("request %s: response deleted while it streamed; its end is not stored", self.request_id)
                    return False
                log.info("request %s: response stored again while it streamed (v%d); its end is written over it",
                         self.request_id, exc.stored_version)
                record.version = exc.stored_version
        raise VersionConflict("the response's record kept changing while its end was stored", param=None,
                              stored_version=record.version)

    def _output(self, status: str, message: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Choice 0 (or `message`) as output items, with the ids the stream announced."""
        assert self.opened is not None
        choice = self.opened.completion.choice(0)
        output = output_items(message or choice.message(), status, choice.logprobs if choice.has_logprobs else None)
        for item in output:
            if item["type"] == "message":
                item["id"] = self.message_id
            elif item["type"] == "function_call":
                item["id"] = call_item_id(item["call_id"])
        return output

    def _unfinished(self, code: str, message: str) -> dict[str, Any]:
        """The response of a stream that ended without its reply (the module docstring): what
        ``response.failed`` carries and what is stored, built once so the two are the same."""
        if self.unfinished is None:
            assert self.opened is not None
            choice = self.opened.completion.choice(0)
            output = self._output("incomplete") if choice.text or choice.calls else []
            usage = response_usage(self.opened.completion.usage.wire())
            if code == CLIENT_DISCONNECTED:
                self.unfinished = self._response("incomplete", output, usage, CLIENT_DISCONNECTED)
            else:
                self.unfinished = self._response("failed", output, usage)
                self.unfinished["error"] = {"code": code if code in RESPONSE_ERROR_CODES else "server_error",
                                            "message": message}
        return self.unfinished

    async def _save_unfinished(self, code: str, message: str) -> None:
        """Store the unfinished response (unless `store: false`): its chain holds its input, not the
        unfinished output, and no conversation gets the turn."""
        response = self._unfinished(code, message)
        rreq = self.rreq
        assert rreq is not None and self.tier is not None
        if rreq.store is False:
            return
        if not await self._save_response(self._response_record(self.history_items + self.new_items, response)):
            return
        await self._index(fresh_items(self.new_items, rreq.input), [Home(Kind.RESPONSE, self.response_id)])
        log.info("request %s: response stored as %s (%s)", self.request_id, response["status"], code)

    async def save_turn(self, reply: str, message: dict[str, Any] | None = None) -> None:
        """Build the response and store it (and the conversation's new items): before the reply
        completes, so a client that continues at once finds it."""
        rreq, opened = self.rreq, self.opened
        assert rreq is not None and opened is not None and self.tier is not None
        finish_reason = opened.completion.finish_reason
        incomplete = INCOMPLETE_REASONS.get(finish_reason or "")
        output = self._output("incomplete" if incomplete else "completed", message)
        self.response = self._response("incomplete" if incomplete else "completed", output,
                                        response_usage(opened.completion.usage.wire()), incomplete)
        items = self.history_items + self.new_items + output
        replicas = self.tier.replication
        saved: list[Record] = []
        if self.conversation is not None:
            self.conversation.items = items
            await self.store.save(self.conversation, self.owner, replicas)
            saved.append(self.conversation)
        if rreq.store is not False:
            record = self._response_record(items, self.response)
            if await self._save_response(record):
                saved.append(record)
        self.let_go()  # the conversation is written: its next turn may start
        await self._index(fresh_items(self.new_items, rreq.input) + output, [Home(r.kind, r.id) for r in saved])
        threshold = next((c.compact_threshold for c in rreq.context_management or () if c.compact_threshold), None)
        for rec in saved:
            if threshold and conversation_tokens(rec.items, self.gw.counter) > threshold:
                self.store.later(compact_record(self.gw, self.rt, self.store, rec, self.owner, replicas, threshold),
                                 name="responses-compaction")


    async def _index(self, items: list[dict[str, Any]], homes: list[Home]) -> None:
        """Index the turn's new stored items (item_index.py), before the reply ends so that a reference sent
        at once resolves (best effort: a failure is logged, the stored turn stands)."""
        assert self.tier is not None
        await index_items(self.store, items, homes, self.owner, self.tier.replication)


def record_caller(gw: Gateway, request: Request) -> tuple[str, int]:
    """Who owns the stored records a request reads or edits (its key's digest) and how many copies
    its tier keeps, after the abuse guard (bans, blocked keys and throttles; 401s counted): the
    stored-response and Conversations routes."""
    _, owner, tier = record_principal(gw, request)
    return owner, tier.replication


def record_principal(gw: Gateway, request: Request) -> tuple[Any, str, Tier]:
    """`record_caller` with the principal itself (its tenant scopes the prefix cache) and its tier."""
    principal, tier = gw.caller(request)  # a key whose tier was removed: 403 (tier_gate.py)
    token = (request.headers.get("authorization") or "").partition(" ")[2].strip()
    return principal, key_digest(token), tier


def mount_responses(app: FastAPI, gw: Gateway, store: Callable[[], ConversationStore]) -> None:
    """DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items on `app` (GET and cancel:
    data_plane/gateway/responses_detached.py; compact: responses_compact.py); `store()` once the lifespan opened it."""

    def caller(request: Request) -> tuple[str, int]:
        return record_caller(gw, request)

    @app.delete(RESPONSES_PATH + "/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.DELETE, request):
            owner, replicas = caller(request)
            await store().delete(response_id, owner, replicas, Kind.RESPONSE)
            log.info("response deleted from every cache node")
            return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get(RESPONSES_PATH + "/{response_id}/input_items")
    async def input_items_list(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                               after: str | None = None) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.INPUT_ITEMS, request):
            owner, replicas = caller(request)
            check_query_include(request)
            record = await store().load(response_id, owner, replicas, Kind.RESPONSE)
            start, end = record.input_range
            return page(record.items[start:end], limit=limit, order=order, after=after)


def check_query_include(request: Request) -> None:
    """OpenAI's 400 for an `include` (the SDK's include[]=...) on an item route that names a value it does
    not define, or one this server never makes, as on create and retrieve (it was ignored)."""
    check_include(request.query_params.getlist("include") + request.query_params.getlist("include[]"))
