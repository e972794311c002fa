"""OpenAI's stored Chat Completions: `store: true` keeps a completion, and its routes read it back.

    c = client.chat.completions.create(model=..., messages=[...], store=True, metadata={"run": "7"})
    client.chat.completions.retrieve(c.id); client.chat.completions.messages.list(c.id)
    client.chat.completions.list(model=..., metadata={"run": "7"}, order="desc", limit=20, after=...)
    client.chat.completions.update(c.id, metadata={...}); client.chat.completions.delete(c.id)

A stored completion is one record of the conversation store (data_plane/gateway/response_store.py,
kind CHAT_COMPLETION): sealed, replicated per the tier, read-repaired, deleted from every cache node;
it holds the completion object (every choice, streamed or not, with the request's `metadata`) and the
request's messages. It belongs to the caller's *tenant* (every key of it sees it; another tenant's id
is a 404, like a missing one), as OpenAI's stored completions belong to a project, not to one key.

Listing needs what a key-value store lacks: one index record per tenant (kind CHAT_INDEX: id,
created, model, metadata of each, oldest first, at most MAX_LISTED, entries past the TTL pruned),
rewritten under the record lock (data_plane/gateway/record_locks.py) when a completion is stored,
updated or deleted. A completion that dropped out of the index is still retrievable by id. A deleted
one leaves a tombstone (its id, created and model, at most MAX_TOMBSTONES) that is never listed but keeps
its place for an `after` cursor: the openai SDK pages on with `after=<last id of the page>`, so an app
that deletes what it lists (`for c in client.chat.completions.list(): ...delete(c.id)`) sends the id
it just deleted, and so does one whose cursor's metadata changed since under a `metadata[...]` filter.

Storing is part of the reply (awaited before the last bytes, so a retrieve right after the create
finds it), but a failure to store is logged and counted, never turned into a failed completion: the
reply is what was asked for, and `store` was accepted and ignored before this existed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from data_plane.common.errors import InvalidRequest, NotFound, SwitchboardError, clipped
from data_plane.gateway.chat import ChatHandler
from data_plane.gateway.conversations import metadata_update
from data_plane.gateway.item_pages import page
from data_plane.gateway.record_locks import ITEM_EDIT_WAIT_S, record_key
from data_plane.gateway.response_store import ConversationStore, Kind, Record
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.protocol import ChatCompletionRequest, ChatMessage
from data_plane.request_checks import json_body, validated
from data_plane.routing.upstream import CHAT_PATH

log = logging.getLogger(__name__)

MAX_LISTED = 10_000
"""Completions one tenant's list holds (the newest); the index record is rewritten on every store."""

MAX_TOMBSTONES = 1_000
"""Deleted completions whose place in the list one tenant's index keeps (the newest), for `after` cursors."""


def tenant_owner(tenant: str) -> str:
    """The owner stored completions are bound to (and sealed for): the tenant, as a digest in its own
    namespace, so it never equals a key's digest (sessions, responses, conversations stay per key)."""
    return hashlib.sha256(f"chat-completions/{tenant}".encode()).hexdigest()


def index_id(owner: str) -> str:
    """The id of the owner's index record (a valid session id; bound to the owner like any record)."""
    return "chatidx_" + hashlib.sha256(owner.encode()).hexdigest()[:40]


def stored_messages(completion_id: str, messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as ChatCompletionStoreMessage objects (id `<completion id>-<index>`)."""
    out = []
    for i, m in enumerate(messages):
        # (`parsed` is the openai SDK's own addition to a message it returns, not part of the message)
        item: dict[str, Any] = {"id": f"{completion_id}-{i}", **m.model_dump(exclude_none=True, exclude={"parsed"})}
        if isinstance(m.content, list):
            item["content"], item["content_parts"] = m.text(), m.model_dump(mode="json")["content"]
        else:
            item["content_parts"] = None
        out.append(item)
    return out


class StoredChatHandler(ChatHandler):
    """`POST /v1/chat/completions`, which also keeps the completion when the request says `store: true`."""

    def __init__(self, gw: Gateway, rt: Runtime, request: Request, store: ConversationStore) -> None:
        super().__init__(gw, rt, request)
        self.store = store
        self.stored_request: ChatCompletionRequest | None = None
        self.sent_messages: list[ChatMessage] = []
        """The request's messages as the client sent them (what `messages.list` gives back)."""

    async def parse(self, raw: bytes) -> ChatCompletionRequest:
        req = await super().parse(raw)
        if req.store:
            self.stored_request = req
            # as sent: the parsed request's are rewritten (legacy function calls as tool calls, a function
            # result of no call as a user message: data_plane/legacy_functions.py), and OpenAI keeps the sent ones
            self.sent_messages = validated(ChatCompletionRequest, json_body(raw, None)).messages
        return req

    async def save_turn(self, reply: str) -> None:
        await super().save_turn(reply)
        req, opened, principal, tier = self.stored_request, self.opened, self.principal, self.tier
        if req is None or opened is None or principal is None or tier is None:
            return
        started = time.perf_counter()
        status = 200
        try:
            completion = {**opened.completion.body(), "metadata": dict(req.metadata or {})}
            record = Record(completion["id"], Kind.CHAT_COMPLETION, stored_messages(completion["id"], self.sent_messages),
                            completion["id"], response=completion)
            owner = tenant_owner(principal.tenant)
            await self.store.save(record, owner, tier.replication)
            await edit_index(self.gw, self.store, owner, tier.replication, add=index_entry(completion))
            log.info("request %s: chat completion stored (%d choice(s), %d message(s))", self.request_id,
                     len(completion["choices"]), len(record.items))
        except SwitchboardError as exc:  # the reply stands; the record is what failed
            status = exc.status
            log.warning("request %s: chat completion not stored: %s", self.request_id, exc.code)
        except Exception as exc:  # noqa: BLE001 -- a bug here must not fail a reply already made
            status = 500
            log.error("request %s: chat completion not stored: %s", self.request_id, type(exc).__name__)
        finally:
            self.gw.responses_metrics.count(Op.CHAT_STORE, status)
            self.gw.responses_metrics.seconds.labels(Op.CHAT_STORE.value).observe(time.perf_counter() - started)


def index_entry(completion: dict[str, Any]) -> dict[str, Any]:
    return {"id": completion["id"], "created": completion["created"], "model": completion["model"],
            "metadata": completion.get("metadata") or {}}


async def edit_index(gw: Gateway, store: ConversationStore, owner: str, replicas: int, *,
                     add: dict[str, Any] | None = None, remove: str | None = None) -> None:
    """Add, replace (same id) or remove one entry of the owner's index. Edits that meet are applied by one
    rewrite, under its record lock (data_plane/gateway/batched_edits.py: a rewrite of a full index takes
    ~0.25 s, one per store made a tenant's concurrent stores wait in line, then fail to store); two
    gateways at once can still race (record_locks.py)."""
    rid = index_id(owner)

    async def write(edits: list[tuple[dict[str, Any] | None, str | None, int]]) -> None:
        key = record_key(owner, rid)
        copies = max(n for _, _, n in edits)
        await gw.record_locks.acquire(key, wait_s=ITEM_EDIT_WAIT_S, param="completion_id")
        try:
            index = await load_index(store, owner, copies)
            entries = list(index.items)
            for added, removed, _ in edits:
                if removed is not None:  # its place stays, as a tombstone, for a cursor (see the module's
                    # docstring); no metadata (the caller's data goes with the record), but an entry's shape
                    # all the same, so a gateway of the previous version lists past it (its record is gone)
                    entries = [{**e, "metadata": {}, "deleted": True} if e["id"] == removed else e for e in entries]
                elif added is not None:  # an update replaces its entry in place: the list's order never moves
                    entries = [added if e["id"] == added["id"] else e for e in entries]
                    if added not in entries:
                        entries.append(added)
            entries.sort(key=lambda e: e["created"])  # stable: same-second stores keep their order
            live = [e for e in entries if not e.get("deleted")][-MAX_LISTED:]
            dead = [e for e in entries if e.get("deleted")][-MAX_TOMBSTONES:]
            kept = {e["id"] for e in live + dead}
            index.items = [e for e in entries if e["id"] in kept]
            await store.save(index, owner, copies)
        finally:
            gw.record_locks.release(key)

    await gw.index_edits.apply(rid, (add, remove, replicas), write)


async def load_index(store: ConversationStore, owner: str, replicas: int) -> Record:
    """The owner's index (empty when it has none yet), without entries older than the store's TTL."""
    try:
        index = await store.load(index_id(owner), owner, replicas, Kind.CHAT_INDEX)
    except NotFound:
        index = Record(index_id(owner), Kind.CHAT_INDEX, [], index_id(owner))
    oldest = time.time() - store.ttl_s
    index.items = [e for e in index.items if e["created"] >= oldest]
    return index


def past_cursor(entries: list[dict[str, Any]], index: list[dict[str, Any]], order: str,
                after: str | None) -> list[dict[str, Any]]:
    """The listed `entries` (oldest first) that come after the cursor `after` in `order`, the cursor placed
    by the whole index (`index`, oldest first): a completion deleted since, or filtered out by its
    metadata now, still marks where the previous page ended. An id the index never held is a 400."""
    if after is None or order not in ("asc", "desc"):  # (a bad order is page()'s 400)
        return entries
    ids = [e["id"] for e in index]
    if after not in ids:
        raise InvalidRequest(f"no item with id {clipped(after)!r}", param="after")
    at = ids.index(after)
    later = set(ids[at + 1:] if order == "asc" else ids[:at])
    return [e for e in entries if e["id"] in later]


def metadata_filter(request: Request) -> dict[str, str]:
    """`metadata[key]=value` query parameters (how the openai SDK sends a dict in a query)."""
    out = {}
    for name, value in request.query_params.multi_items():
        if name.startswith("metadata[") and name.endswith("]"):
            out[name[len("metadata["):-1]] = value
        elif name == "metadata":
            raise InvalidRequest("metadata filters are sent as metadata[key]=value", param="metadata")
    return out


def mount_chat_store(app: FastAPI, gw: Gateway, store: Callable[[], ConversationStore]) -> None:
    """The stored Chat Completions routes on `app` (POST /v1/chat/completions itself is GatewayApp's)."""

    def caller(request: Request) -> tuple[str, int]:
        """The tenant's owner digest and the tier's replicas, after the abuse guard (bans, blocked keys
        and throttles; 401s counted) and the tier gate (a removed tier: 403), as the other stored-record routes."""
        principal, tier = gw.caller(request)
        return tenant_owner(principal.tenant), tier.replication

    async def load(completion_id: str, owner: str, replicas: int) -> Record:
        return await store().load(completion_id, owner, replicas, Kind.CHAT_COMPLETION)

    @app.get(CHAT_PATH)
    async def list_completions(request: Request, limit: int = 20, order: str = "asc", after: str | None = None,
                               model: str | None = None) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CHAT_LIST, request):
            owner, replicas = caller(request)
            wanted = metadata_filter(request)
            index = await load_index(store(), owner, replicas)
            entries = [e for e in index.items if not e.get("deleted") and (model is None or e["model"] == model)
                       and all(e["metadata"].get(k) == v for k, v in wanted.items())]
            listed = page(past_cursor(entries, index.items, order, after), limit=limit, order=order, after=None)
            found = await asyncio.gather(*(load(e["id"], owner, replicas) for e in listed["data"]),
                                         return_exceptions=True)
            for got in found:  # a record gone meanwhile is left out; a cache failure is the answer
                if isinstance(got, BaseException) and not isinstance(got, NotFound):
                    raise got
            data = [dict(r.response or {}) for r in found if isinstance(r, Record)]
            return {**listed, "data": data, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None}

    @app.get(CHAT_PATH + "/{completion_id}")
    async def retrieve(completion_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CHAT_RETRIEVE, request):
            owner, replicas = caller(request)
            return dict((await load(completion_id, owner, replicas)).response or {})

    @app.post(CHAT_PATH + "/{completion_id}")
    async def update(completion_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CHAT_UPDATE, request):
            owner, replicas = caller(request)
            metadata = await metadata_update(request, gw.settings.max_body_bytes)
            key = record_key(owner, completion_id)
            await gw.record_locks.acquire(key, wait_s=ITEM_EDIT_WAIT_S, param="completion_id")
            try:
                record = await load(completion_id, owner, replicas)
                completion = record.response = {**(record.response or {}), "metadata": metadata}
                await store().save(record, owner, replicas)
            finally:
                gw.record_locks.release(key)
            await edit_index(gw, store(), owner, replicas, add=index_entry(completion))
            return dict(completion)

    @app.delete(CHAT_PATH + "/{completion_id}")
    async def delete(completion_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CHAT_DELETE, request):
            owner, replicas = caller(request)
            await store().delete(completion_id, owner, replicas, Kind.CHAT_COMPLETION)
            await edit_index(gw, store(), owner, replicas, remove=completion_id)
            log.info("chat completion deleted from every cache node")
            return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}

    @app.get(CHAT_PATH + "/{completion_id}/messages")
    async def messages(completion_id: str, request: Request, limit: int = 20, order: str = "asc",
                       after: str | None = None) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CHAT_MESSAGES, request):
            owner, replicas = caller(request)
            record = await load(completion_id, owner, replicas)
            return page(record.items, limit=limit, order=order, after=after)
