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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from opentelemetry import trace
from starlette.types import Send

from data_plane.common.errors import ContextLengthExceeded, InvalidRequest
from data_plane.gateway.auth import key_digest
from data_plane.gateway.chat import ChatHandler, Opened
from data_plane.gateway.context import Window, fit_window
from data_plane.gateway.response_store import ConversationStore, Kind, Record
from data_plane.gateway.responses_items import (
    ResponsesRequest,
    input_items,
    items_to_messages,
    new_id,
    output_items,
    parse_responses_request,
    response_object,
    response_usage,
)
from data_plane.gateway.responses_stream import ResponseEvents, call_item_id
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.protocol import ChatCompletionRequest
from data_plane.tiers import Tier

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

RESPONSES_PATH = "/v1/responses"
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


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
        self.conversation: Record | None = None
        self.route = self.response_id
        self.instructions = 0
        self.response: dict[str, Any] | None = None
        self.x.span.set_attribute("switchboard.response_id", self.response_id)

    # -- the request -----------------------------------------------------------------------------

    def parse(self, raw: bytes) -> ChatCompletionRequest:
        rreq = self.rreq = parse_responses_request(raw, self.request.headers.get("content-type"))
        self.new_items = input_items(rreq.input)
        if not self.new_items:
            raise InvalidRequest("input is required", param="input")
        system = [{"role": "system", "content": rreq.instructions}] if rreq.instructions else []
        self.instructions = len(system)
        return rreq.chat_request(system + items_to_messages(self.new_items))

    async def context(self, req: ChatCompletionRequest, messages: list[dict[str, str]],
                      tier: Tier) -> list[dict[str, str]]:
        rreq = self.rreq
        assert rreq is not None
        conv_id = rreq.conversation_id
        if rreq.previous_response_id:
            previous = await self.store.load(rreq.previous_response_id, self.owner, tier.replication, Kind.RESPONSE)
            self.history_items, self.route = previous.items, previous.route
        elif conv_id:
            self.conversation = await self.store.load(conv_id, self.owner, tier.replication, Kind.CONVERSATION)
            self.history_items, self.route = self.conversation.items, self.conversation.route
        if self.history_items or rreq.store is not False or self.conversation is not None:
            # the chain's session: kv_aware routing and the KV blocks kept on its cache nodes
            self.session_id = self.route
        self.x.span.set_attribute("switchboard.responses.history_items", len(self.history_items))
        history = items_to_messages(self.history_items)
        return messages[:self.instructions] + history + messages[self.instructions:]

    def fit(self, prompt: list[dict[str, str]], budget: int) -> Window:
        rreq = self.rreq
        assert rreq is not None
        if rreq.truncation != "auto":
            total = self.gw.counter.prompt_tokens(prompt)
            if total > budget:
                raise ContextLengthExceeded(
                    f"the conversation is {total} tokens, over the {budget} this request leaves for input; "
                    "set truncation to 'auto' to drop (and recall) earlier turns", param="input")
            return Window(list(prompt), total, 0)
        return fit_window(prompt, self.gw.counter, budget)

    # -- the reply -------------------------------------------------------------------------------

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  incomplete: str | None = None) -> dict[str, Any]:
        assert self.rreq is not None
        model = self.opened.completion.model if self.opened is not None else self.rreq.model
        return response_object(self.response_id, self.rreq, model, status=status, output=output, usage=usage,
                               created_at=self.created_at, incomplete=incomplete)

    def _final(self, finish_reason: str | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        if self.response is not None:
            return self.response
        assert self.opened is not None
        incomplete = INCOMPLETE_REASONS.get(finish_reason or "")
        return self._response("incomplete" if incomplete else "completed", output,
                              response_usage(self.opened.completion.usage.wire()), incomplete)

    async def respond_body(self, opened: Opened) -> dict[str, Any]:
        body = await opened.completion.collect(opened.stream)
        if self.response is not None:
            return self.response
        choice = body["choices"][0]
        return self._final(choice.get("finish_reason"), output_items(choice["message"]))

    async def respond_stream(self, opened: Opened, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        events = ResponseEvents(send, start=lambda: self._response("in_progress", [], None),
                                finish=self._final, message_id=self.message_id)
        await opened.completion.stream_to(events.send, opened.stream, True, headers)

    async def save_turn(self, reply: str, message: dict[str, Any] | None = None) -> None:
        """Build the response and store it (and the conversation's new items): before the reply
        completes, so a client that continues at once finds it."""
        rreq, opened = self.rreq, self.opened
        assert rreq is not None and opened is not None and self.tier is not None
        finish_reason = opened.completion.finish_reason
        incomplete = INCOMPLETE_REASONS.get(finish_reason or "")
        output = output_items(message or {"content": reply}, "incomplete" if incomplete else "completed")
        for item in output:  # the same ids the stream announced
            if item["type"] == "message":
                item["id"] = self.message_id
            elif item["type"] == "function_call":
                item["id"] = call_item_id(item["call_id"])
        self.response = self._response("incomplete" if incomplete else "completed", output,
                                        response_usage(opened.completion.usage.wire()), incomplete)
        items = self.history_items + self.new_items + output
        replicas = self.tier.replication
        if self.conversation is not None:
            self.conversation.items = items
            await self.store.save(self.conversation, self.owner, replicas)
        if rreq.store is not False:
            start = len(self.history_items)
            record = Record(self.response_id, Kind.RESPONSE, items, self.route, response=self.response,
                            input_range=(start, start + len(self.new_items)))
            await self.store.save(record, self.owner, replicas)


def mount_responses(app: FastAPI, gw: Gateway, store: Any) -> None:
    """GET/DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items on `app`; `store()`
    gives the ConversationStore once the runtime is open."""

    def caller(request: Request) -> tuple[str, int]:
        principal = gw.keys.authenticate(request.headers.get("authorization"))
        token = (request.headers.get("authorization") or "").partition(" ")[2].strip()
        return key_digest(token), gw.tiers.get(principal.tier).replication

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
        owner, replicas = caller(request)
        record = await store().load(response_id, owner, replicas, Kind.RESPONSE)
        return dict(record.response or {})

    @app.delete(RESPONSES_PATH + "/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        owner, replicas = caller(request)
        await store().delete(response_id, owner, replicas, Kind.RESPONSE)
        log.info("response deleted from every cache node")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get(RESPONSES_PATH + "/{response_id}/input_items")
    async def input_items_list(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                               after: str | None = None) -> dict[str, Any]:
        owner, replicas = caller(request)
        record = await store().load(response_id, owner, replicas, Kind.RESPONSE)
        start, end = record.input_range
        return page(record.items[start:end], limit=limit, order=order, after=after)


def page(items: list[dict[str, Any]], *, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor list: `order` asc|desc, `after` an item id, at most `limit` (1-100)."""
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise InvalidRequest(f"no item with id {after!r}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
