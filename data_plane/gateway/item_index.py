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

Resolving a reference costs two cache reads (the index record, then the home); storing a turn one read
and one write per new item, concurrently.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from data_plane.common.errors import NotFound, SwitchboardError
from data_plane.gateway.response_store import ConversationStore, Kind, Record

log = logging.getLogger(__name__)

REFERENCE = "item_reference"
MAX_HOMES = 16
"""Homes one index record keeps (the newest): an id a client reuses in many conversations."""


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
    return NotFound(f"Item with id '{item_id}' not found. Items are not persisted when `store` is set to false. "
                    "Try again with `store` set to true, or remove this item from your input.", param=param)


async def index_items(store: ConversationStore, items: list[dict[str, Any]], homes: list[Home], owner: str,
                      replicas: int) -> None:
    """Add `homes` to the index records of `items` (each read, merged, written back; all at once)."""
    if homes:
        await asyncio.gather(*(_add(store, item["id"], homes, owner, replicas) for item in items))


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
                             param: str = "input") -> list[dict[str, Any]]:
    """`items` with each ``item_reference`` replaced by the item it names (a 404 naming `param` if it does
    not resolve for `owner`); the others as they are."""
    refs = [item["id"] for item in items if item["type"] == REFERENCE]
    if not refs:
        return items
    found = dict(zip(refs, await asyncio.gather(*(resolve(store, i, owner, replicas, param) for i in refs)),
                     strict=True))
    return [found[item["id"]] if item["type"] == REFERENCE else item for item in items]


async def resolve(store: ConversationStore, item_id: str, owner: str, replicas: int, param: str) -> dict[str, Any]:
    """The stored item `item_id` of `owner`, from the first of its homes that still holds it."""
    try:
        index = await store.load(index_id(owner, item_id), owner, replicas, Kind.ITEM_INDEX)
    except NotFound:
        raise unknown_item(item_id, param) from None
    for home in index.items:
        try:
            record = await store.load(home["id"], owner, replicas, Kind(home["kind"]))
        except SwitchboardError as exc:
            if exc.status != 404:
                raise
            continue  # deleted: its items are gone with it
        item = next((i for i in record.items if i.get("id") == item_id), None)
        if item is not None:
            return dict(item)
    raise unknown_item(item_id, param)
