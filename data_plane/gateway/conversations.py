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

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from data_plane.common.errors import InvalidRequest, NotFound
from data_plane.gateway.auth import key_digest
from data_plane.gateway.response_store import ConversationStore, Kind, conversation_object, new_conversation
from data_plane.gateway.responses import page
from data_plane.gateway.responses_items import input_items, new_id
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.runtime import Gateway

log = logging.getLogger(__name__)

CONVERSATIONS_PATH = "/v1/conversations"
MAX_METADATA = 16


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise InvalidRequest("metadata: at most 16 string pairs (keys <= 64, values <= 512 characters)",
                             param="metadata")
    return value


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        import json

        body = json.loads(raw)
    except ValueError:
        raise InvalidRequest("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return body


def mount_conversations(app: FastAPI, gw: Gateway, store: Callable[[], ConversationStore]) -> None:
    """The Conversations API's routes on `app`; `store()` gives the ConversationStore once the runtime is open."""

    def caller(request: Request) -> tuple[str, int]:
        principal = gw.keys.authenticate(request.headers.get("authorization"))
        token = (request.headers.get("authorization") or "").partition(" ")[2].strip()
        return key_digest(token), gw.tiers.get(principal.tier).replication

    @app.post(CONVERSATIONS_PATH)
    async def create(request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CONVERSATION_CREATE):
            owner, replicas = caller(request)
            body = await _body(request)
            unknown = set(body) - {"items", "metadata"}
            if unknown:
                raise InvalidRequest(f"unrecognized request argument supplied: {min(unknown)}",
                                     param=min(unknown), code="unsupported_parameter")
            items = input_items(body.get("items") or [], param="items")
            record = new_conversation(new_id("conv"), items, _metadata(body.get("metadata")))
            await store().save(record, owner, replicas)
            log.info("conversation created with %d item(s)", len(items))
            return conversation_object(record)

    @app.get(CONVERSATIONS_PATH + "/{conversation_id}")
    async def retrieve(conversation_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CONVERSATION_RETRIEVE):
            owner, replicas = caller(request)
            return conversation_object(await store().load(conversation_id, owner, replicas, Kind.CONVERSATION))

    @app.post(CONVERSATIONS_PATH + "/{conversation_id}")
    async def update(conversation_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CONVERSATION_UPDATE):
            owner, replicas = caller(request)
            body = await _body(request)
            if set(body) != {"metadata"}:
                raise InvalidRequest("metadata is required (and the only field)", param="metadata")
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            record.conversation["metadata"] = _metadata(body["metadata"]) or {}
            await store().save(record, owner, replicas)
            return conversation_object(record)

    @app.delete(CONVERSATIONS_PATH + "/{conversation_id}")
    async def delete(conversation_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CONVERSATION_DELETE):
            owner, replicas = caller(request)
            await store().delete(conversation_id, owner, replicas, Kind.CONVERSATION)
            return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.get(CONVERSATIONS_PATH + "/{conversation_id}/items")
    async def list_items(conversation_id: str, request: Request, limit: int = 20, order: str = "desc",
                         after: str | None = None) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.ITEMS_LIST):
            owner, replicas = caller(request)
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            return page(record.items, limit=limit, order=order, after=after)

    @app.post(CONVERSATIONS_PATH + "/{conversation_id}/items")
    async def add_items(conversation_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.ITEMS_CREATE):
            owner, replicas = caller(request)
            body = await _body(request)
            items = input_items(body.get("items") or [], param="items")
            if not items:
                raise InvalidRequest("items must hold at least one item", param="items")
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            record.items = record.items + items
            await store().save(record, owner, replicas)
            return {"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
                    "has_more": False}

    @app.get(CONVERSATIONS_PATH + "/{conversation_id}/items/{item_id}")
    async def get_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.ITEM_RETRIEVE):
            owner, replicas = caller(request)
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            for item in record.items:
                if item.get("id") == item_id:
                    return item
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")

    @app.delete(CONVERSATIONS_PATH + "/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.ITEM_DELETE):
            owner, replicas = caller(request)
            record = await store().load(conversation_id, owner, replicas, Kind.CONVERSATION)
            kept = [i for i in record.items if i.get("id") != item_id]
            if len(kept) == len(record.items):
                raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
            record.items = kept
            await store().save(record, owner, replicas)
            return conversation_object(record)
