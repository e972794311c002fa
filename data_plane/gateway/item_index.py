"""`item_reference` input items: a stored item named by its id, found through an index by owner and id.

    items = input_items(body["input"])                                   # references stay placeholders
    items = await resolve_references(store, items, owner, replicas)      # each replaced by its stored item
    await index_items(store, new_items, [Home(Kind.RESPONSE, resp_id)], owner, replicas)   # when stored

OpenAI's Responses API takes ``{"type": "item_reference", "id": "msg_..."}`` in ``input``: an item the
caller stored before (an input or output item of a stored response, an item of a conversation), so a
client that keeps its own history (Codex, the openai SDK's ``ItemReference``) need not send it again.

Finding an item by id must not scan every record, so each stored item has one index record (kind
ITEM_INDEX) in the conversation store: the same cache nodes, sealed and bound to the key like every
record (another key's lookup is a miss, exactly like an unknown id). Its id is a digest of the owner
and the item id; it holds the item's homes, the response and conversation records that hold it, newest
first. The item itself is read from its home, so deleting a response or a conversation (or an item of
a conversation) is enough for its items to stop resolving: the index is never the item's copy. An item
folded into a compaction item is no longer in its home either, and does not resolve.

A reference to an item of the chain or conversation the request continues is taken from it, with no
read. Any other costs two cache reads (the index record, then the home; a home read once per request),
and a request may name at most MAX_REFERENCES distinct ids. Storing a turn indexes only the items new
to storage (its output, and input items the server gave an id: `fresh_items`): one read and one write
each, CONCURRENCY at a time, so a client that resends its whole history every turn adds no index work.
An index record lives as the cache's records do (`--session-ttl-s` from its last write): past that, its
item still resolves within its own chain or conversation, not from elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from data_plane.common.errors import InvalidRequest, NotFound, SwitchboardError, clipped
from data_plane.gateway.response_store import ConversationStore, Kind, Record

log = logging.getLogger(__name__)

REFERENCE = "item_reference"
MAX_HOMES = 16
"""Homes one index record keeps (the newest): an id a client reuses in many conversations."""
MAX_REFERENCES = 128
"""Distinct item ids one request may reference (each costs reads before admission)."""
CONCURRENCY = 8
"""Cache reads or writes one request's references or one turn's index has in flight at once."""


@dataclass(frozen=True)
class Home:
    """A record that holds an item: a stored response (its input and output) or a conversation."""

    kind: Kind
    id: str


def index_id(owner: str, item_id: str) -> str:
    """The index record of `item_id` for `owner` (a valid session id, whatever the item id is)."""
    return "itemidx_" + hashlib.sha256(f"{owner}\0{item_id}".encode()).hexdigest()[:48]


def unknown_item(item_id: str, param: str) -> NotFound:
    """OpenAI's 404 for an item reference it cannot resolve (never stored, deleted, another key's)."""
    return NotFound(f"Item with id '{clipped(item_id)}' not found. Items are not persisted when `store` is set to false. "
                    "Try again with `store` set to true, or remove this item from your input.", param=param)


def fresh_items(items: list[dict[str, Any]], sent: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    """The items of `items` new to storage: those whose id the client did not send in `sent` (the raw
    `input` or `items`). An id the client sent names an item stored before (indexed then: a history the
    Agents SDK resends each turn costs no index writes) or a reference; an id it made up itself resolves
    within its own chain or conversation only."""
    ids = {raw.get("id") for raw in sent if isinstance(raw, dict)} if isinstance(sent, list) else set()
    return [item for item in items if item.get("id") not in ids]


async def index_items(store: ConversationStore, items: list[dict[str, Any]], homes: list[Home], owner: str,
                      replicas: int) -> None:
    """Add `homes` to the index records of `items` (each read, merged, written back; at most CONCURRENCY at
    once). Best effort: a failure is logged, and leaves those items resolvable in their own chain or
    conversation only; the turn that stored them stands (never a 409 or a 503 for a stored turn)."""
    if not homes or not items:
        return
    limit = asyncio.Semaphore(CONCURRENCY)

    async def add(item_id: str) -> None:
        async with limit:
            await _add(store, item_id, homes, owner, replicas)

    for outcome in await asyncio.gather(*(add(item["id"]) for item in items), return_exceptions=True):
        if isinstance(outcome, SwitchboardError):
            log.warning("stored items not indexed: %s", outcome.code)
        elif isinstance(outcome, BaseException):
            raise outcome


async def _add(store: ConversationStore, item_id: str, homes: list[Home], owner: str, replicas: int) -> None:
    record_id = index_id(owner, item_id)
    try:
        record = await store.load(record_id, owner, replicas, Kind.ITEM_INDEX)
    except NotFound:
        record = Record(record_id, Kind.ITEM_INDEX, [], record_id)
    known = [Home(Kind(h["kind"]), h["id"]) for h in record.items]
    merged = list(dict.fromkeys([*homes, *known]))[:MAX_HOMES]
    if merged != known:
        record.items = [{"kind": h.kind.value, "id": h.id} for h in merged]
        await store.save(record, owner, replicas)


async def resolve_references(store: ConversationStore, items: list[dict[str, Any]], owner: str, replicas: int,
                             param: str = "input", local: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`items` with each ``item_reference`` replaced by the item it names (a 404 naming `param` if it does
    not resolve for `owner`); the others as they are. An id in `local` (the chain or conversation the
    request continues, already loaded) is taken from there without a read; each other distinct id costs
    an index read, and each distinct home one read, at most CONCURRENCY at once. More than
    MAX_REFERENCES distinct ids is a 400 before anything is read."""
    refs = list(dict.fromkeys(item["id"] for item in items if item["type"] == REFERENCE))
    if not refs:
        return items
    if len(refs) > MAX_REFERENCES:
        raise InvalidRequest(f"at most {MAX_REFERENCES} item references are allowed in one request "
                             f"(got {len(refs)})", param=param)
    near = {item.get("id"): item for item in local or ()}
    found = {ref: dict(near[ref]) for ref in refs if ref in near}
    homes = _Homes(store, owner, replicas)
    far = [ref for ref in refs if ref not in found]
    outcomes = await asyncio.gather(*(_resolve(homes, ref, param) for ref in far), return_exceptions=True)
    for ref, outcome in zip(far, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            raise outcome  # the first in the request's order, whichever read ended first
        found[ref] = outcome
    return [found[item["id"]] if item["type"] == REFERENCE else item for item in items]


class _Homes:
    """Index records and homes read for one request: each at most once, CONCURRENCY reads at a time."""

    def __init__(self, store: ConversationStore, owner: str, replicas: int) -> None:
        self.store, self.owner, self.replicas = store, owner, replicas
        self.limit = asyncio.Semaphore(CONCURRENCY)
        self.reads: dict[tuple[str, Kind], asyncio.Future[Record | None]] = {}

    async def read(self, record_id: str, kind: Kind) -> Record | None:
        """The record, or None if it is gone (deleted, expired, never there, another key's)."""
        key = (record_id, kind)
        if key not in self.reads:
            self.reads[key] = asyncio.ensure_future(self._read(record_id, kind))
        return await self.reads[key]

    async def _read(self, record_id: str, kind: Kind) -> Record | None:
        async with self.limit:
            try:
                return await self.store.load(record_id, self.owner, self.replicas, kind)
            except SwitchboardError as exc:
                if exc.status != 404:
                    raise
                return None


async def _resolve(homes: _Homes, item_id: str, param: str) -> dict[str, Any]:
    """The stored item `item_id`, from the first of its homes that still holds it."""
    index = await homes.read(index_id(homes.owner, item_id), Kind.ITEM_INDEX)
    for home in index.items if index is not None else ():
        record = await homes.read(home["id"], Kind(home["kind"]))
        item = next((i for i in record.items if i.get("id") == item_id), None) if record is not None else None
        if item is not None:
            return dict(item)
    raise unknown_item(item_id, param)
