"""OpenAI's Conversations API: `/v1/conversations` and its items, on the conversation store.

    conv = client.conversations.create(items=[{"role": "user", "content": "Hi"}], metadata={"a": "b"})
    client.responses.create(model=..., input="Go on", conversation=conv.id)   # appends its turn
    client.conversations.items.list(conv.id); client.conversations.items.create(conv.id, items=[...])
    client.conversations.update(conv.id, metadata={...}); client.conversations.delete(conv.id)

A conversation is one session record (data_plane/gateway/response_store.py): sealed, replicated per
the tier, bound to the key that created it (another key's id is a 404), and deleted from every cache
node. Its id routes its turns (kv_aware routing keeps them on the shard holding its KV).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from data_plane.common.errors import InvalidRequest, NotFound, UnsupportedParameter, clipped
from data_plane.common.http_body import read_body
from data_plane.gateway.item_index import Home, fresh_items, index_items, resolve_references
from data_plane.gateway.item_pages import deleted_before, page
from data_plane.gateway.memory import Unseal, open_compaction
from data_plane.gateway.record_locks import ITEM_EDIT_WAIT_S, record_key
from data_plane.gateway.response_store import ConversationStore, Kind, conversation_object, new_conversation
from data_plane.gateway.responses import (
    check_query_include,
    record_caller,
    record_principal,
)
from data_plane.gateway.responses_compaction import conversation_tokens, unsealer
from data_plane.gateway.responses_input import input_items, new_id, refuse_duplicates
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.request_checks import json_body, json_type, metadata_bounds
from data_plane.tiers import Tier

log = logging.getLogger(__name__)

CONVERSATIONS_PATH = "/v1/conversations"
MAX_ITEMS_AT_ONCE = 20
"""OpenAI's limit on the items one create or items.create call adds."""


def _items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body's `items` as stored items: a list of at most 20 (anything else is a 400, never
    silently an empty conversation)."""
    raw = body.get("items")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest("items must be an array of items", param="items")
    if len(raw) > MAX_ITEMS_AT_ONCE:
        raise InvalidRequest(f"items holds {len(raw)} items; at most {MAX_ITEMS_AT_ONCE} can be added at a time",
                             param="items")
    return input_items(raw, param="items")


def _opened(items: list[dict[str, Any]], unseal: Unseal) -> list[dict[str, Any]]:
    """`items`, once each compaction item among them opens for this key (400 otherwise). Stored unchecked,
    one that does not (another key's, tampered, made up) made every later turn of the conversation a 400
    (`/v1/responses` opens them to build the prompt) until the item was deleted by hand."""
    for i, item in enumerate(items):
        if item["type"] != "compaction":
            continue
        try:
            open_compaction(item["encrypted_content"], unseal)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, param=f"items[{i}]", code=exc.code) from None
        except ValueError:
            raise InvalidRequest("a compaction item's encrypted_content does not open for this API key",
                                 param=f"items[{i}]", code="invalid_encrypted_content") from None
    return items


def metadata_value(value: Any) -> dict[str, str] | None:
    """A request's `metadata` as OpenAI bounds it (also for stored chat completions' updates)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"Invalid type for 'metadata': expected an object, but got {json_type(value)} instead.",
                             param="metadata", code="invalid_type")
    for key, text in value.items():
        if not isinstance(text, str):
            raise InvalidRequest(f"Invalid type for 'metadata.{key[:64]}': expected a string, but got "
                                 f"{json_type(text)} instead.", param="metadata", code="invalid_type")
    problem = metadata_bounds(value)
    if problem is not None:  # the chat and Responses bodies' words (request_checks.py)
        raise InvalidRequest(problem[0], param="metadata", code=problem[1])
    return value


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object a route was sent ({} for none), read and checked as the Responses API reads its own
    (data_plane/common/http_body.py `read_body`: 413 past `limit` bytes, never buffering more, 408 for a
    stalled body; data_plane/request_checks.py `json_body`: 415, nesting, UTF-8, lone surrogates). It was read
    whole, unbounded: a 200 MB body took the gateway from 116 to 477 MB for a 400."""
    raw = await read_body(request, limit)
    return json_body(raw, request.headers.get("content-type")) if raw else {}


async def metadata_update(request: Request, limit: int) -> dict[str, str]:
    """An update's body (at most `limit` bytes): `metadata` and nothing else (a conversation's, a stored chat
    completion's)."""
    body = await _body(request, limit)
    unknown = sorted(set(body) - {"metadata"})
    if unknown:  # the field the client sent, as create's 400 names it (it said "metadata is required")
        raise UnsupportedParameter(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    if "metadata" not in body:
        raise InvalidRequest("metadata is required (and the only field that can be updated)", param="metadata")
    return metadata_value(body["metadata"]) or {}


def mount_conversations(app: FastAPI, gw: Gateway, store: Callable[[], ConversationStore],
                        runtime: Callable[[], Runtime]) -> None:
    """The Conversations API's routes on `app`; `store()` and `runtime()` once the lifespan opened them."""

    def caller(request: Request) -> tuple[str, int]:
        return record_caller(gw, request)

    async def charged(principal: Any, tier: Tier, items: list[dict[str, Any]]) -> dict[str, str]:
        """One request and the items' tokens from the key's (and tier's) RPM/TPM, as a turn that sent them
        would take (429 + Retry-After); the `x-ratelimit-*` headers. Unmetered, one free key stored
        conversations at ~45/s, up to 1 MiB each, into the cache nodes' shared LRU: every tenant's
        conversations and stored responses were evicted within seconds. Every write takes it (a metadata
        update and an item delete too, no tokens: each rewrites the whole record on every replica, and
        unmetered a key could rewrite a 4 MiB conversation as fast as the gateway answered)."""
        tokens = conversation_tokens(items, gw.counter) if items else 0
        return (await gw.limiter.admit(principal.key_id, tier, tokens)).headers

    @contextlib.asynccontextmanager
    async def editing(owner: str, conversation_id: str) -> AsyncIterator[None]:
        """Hold the conversation's write lock (shared with responses in it, keyed the same way:
        data_plane/gateway/record_locks.py) across a load-modify-save, so no edit is lost."""
        key = record_key(owner, conversation_id)
        await gw.record_locks.acquire(key, wait_s=ITEM_EDIT_WAIT_S, param="conversation_id")
        try:
            yield
        finally:
            gw.record_locks.release(key)

    @app.post(CONVERSATIONS_PATH)
    async def create(request: Request) -> JSONResponse:
        with observed(gw.responses_metrics, Op.CONVERSATION_CREATE, request):
            principal, owner, tier = record_principal(gw, request)
            replicas = tier.replication
            body = await _body(request, gw.settings.max_body_bytes)
            unknown = set(body) - {"items", "metadata"}
            if unknown:
                raise InvalidRequest(f"Unrecognized request argument supplied: {min(unknown)}",
                                     param=min(unknown), code="unsupported_parameter")
            sent = _opened(_items(body), unsealer(runtime(), owner))
            items = await resolve_references(store(), sent, owner, replicas, "items")
            record = new_conversation(new_id("conv"), items, metadata_value(body.get("metadata")))
            headers = await charged(principal, tier, items)
            await store().save(record, owner, replicas)
            await index_items(store(), fresh_items(items, body.get("items") or []), [Home(Kind.CONVERSATION, record.id)],
                              owner, replicas)
            log.info("conversation created with %d item(s)", len(items))
            return JSONResponse(conversation_object(record), headers=headers)

    @app.get(CONVERSATIONS_PATH + "/{conversation_id}")
    async def retrieve(conversation_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CONVERSATION_RETRIEVE, request):
            owner, replicas = caller(request)
            return conversation_object(await store().load(conversation_id, owner, replicas, Kind.CONVERSATION))

    @app.post(CONVERSATIONS_PATH + "/{conversation_id}")
    async def update(conversation_id: str, request: Request) -> JSONResponse:
        with observed(gw.responses_metrics, Op.CONVERSATION_UPDATE, request):
            principal, owner, tier = record_principal(gw, request)
            replicas = tier.replication
            headers = await charged(principal, tier, [])  # a write, as items.create's: one request of the RPM
            metadata = await metadata_update(request, gw.settings.max_body_bytes)
            async with editing(owner, conversation_id):
                record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
                record.conversation["metadata"] = metadata
                await store().save(record, owner, replicas)
            return JSONResponse(conversation_object(record), headers=headers)

    @app.delete(CONVERSATIONS_PATH + "/{conversation_id}")
    async def delete(conversation_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CONVERSATION_DELETE, request):
            owner, replicas = caller(request)
            await store().delete(conversation_id, owner, replicas, Kind.CONVERSATION)
            return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.get(CONVERSATIONS_PATH + "/{conversation_id}/items")
    async def list_items(conversation_id: str, request: Request, limit: int = 20, order: str = "desc",
                         after: str | None = None) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.ITEMS_LIST, request):
            owner, replicas = caller(request)
            check_query_include(request)
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            return page(record.items, limit=limit, order=order, after=after, gone=record.conversation.get("deleted"))

    @app.post(CONVERSATIONS_PATH + "/{conversation_id}/items")
    async def add_items(conversation_id: str, request: Request) -> JSONResponse:
        with observed(gw.responses_metrics, Op.ITEMS_CREATE, request):
            principal, owner, tier = record_principal(gw, request)
            replicas = tier.replication
            check_query_include(request)
            body = await _body(request, gw.settings.max_body_bytes)
            sent = _opened(_items(body), unsealer(runtime(), owner))
            if not sent:
                raise InvalidRequest("items must hold at least one item", param="items")
            headers = await charged(principal, tier, sent)
            async with editing(owner, conversation_id):
                record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
                items = await resolve_references(store(), sent, owner, replicas, "items", local=record.items)
                refuse_duplicates(items, "items", record.items)
                record.items = record.items + items
                await store().save(record, owner, replicas)
            await index_items(store(), fresh_items(items, body.get("items") or []),
                              [Home(Kind.CONVERSATION, conversation_id)], owner, replicas)
            return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"],
                                 "last_id": items[-1]["id"], "has_more": False}, headers=headers)

    @app.get(CONVERSATIONS_PATH + "/{conversation_id}/items/{item_id}")
    async def get_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.ITEM_RETRIEVE, request):
            owner, replicas = caller(request)
            check_query_include(request)
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            for item in record.items:
                if item.get("id") == item_id:
                    return item
            raise NotFound(f"Item with id '{clipped(item_id)}' not found.", param="item_id")

    @app.delete(CONVERSATIONS_PATH + "/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
        with observed(gw.responses_metrics, Op.ITEM_DELETE, request):
            principal, owner, tier = record_principal(gw, request)
            replicas = tier.replication
            headers = await charged(principal, tier, [])  # a write: one request of the RPM
            async with editing(owner, conversation_id):
                record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
                kept = [i for i in record.items if i.get("id") != item_id]
                if len(kept) == len(record.items):
                    raise NotFound(f"Item with id '{clipped(item_id)}' not found.", param="item_id")
                deleted_before(record.conversation.setdefault("deleted", {}), record.items, item_id)
                record.items = kept
                await store().save(record, owner, replicas)
            return JSONResponse(conversation_object(record), headers=headers)
