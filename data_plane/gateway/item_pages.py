"""Cursor pages of stored items (a response's input items, a conversation's items, stored chat completions),
as OpenAI's lists page them, and the places of deleted items a cursor may still name.

    page(items, limit=20, order="desc", after="msg_...", gone=record.conversation.get("deleted"))
    deleted_before(record.conversation.setdefault("deleted", {}), record.items, item_id)
"""

from __future__ import annotations

from typing import Any

from data_plane.common.errors import InvalidRequest, clipped


def page(items: list[dict[str, Any]], *, limit: int, order: str, after: str | None,
         gone: dict[str, str | None] | None = None) -> dict[str, Any]:
    """OpenAI's cursor list: `order` asc|desc, `after` an item id, at most `limit` (1-100). `gone`: the
    items deleted from `items`, each with the id before it then (None: it was first), so an `after` that
    names one still finds its place (see `deleted_before`)."""
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    ordered = list(items)
    if after is not None:
        ids = [i.get("id") for i in ordered]
        gone = gone or {}
        cursor: str | None = after
        for _ in range(len(gone)):  # a deleted item: the place of the one before it (bounded: no cycle loops)
            if cursor is None or cursor in ids or cursor not in gone:
                break
            cursor = gone[cursor]
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"no item with id {clipped(after)!r}", param="after")
        at = ids.index(cursor) if cursor is not None else -1
        if cursor == after:  # the cursor itself is listed: the rest, past it, in this order
            ordered = ordered[at + 1:] if order == "asc" else ordered[:at][::-1]
        else:  # a deleted cursor stood right after `at`
            ordered = ordered[at + 1:] if order == "asc" else ordered[:at + 1][::-1]
    elif order == "desc":
        ordered.reverse()
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


MAX_GONE = 256
"""Deleted items a conversation remembers the place of (a cursor naming an older one is the 400)."""


def deleted_before(gone: dict[str, str | None], items: list[dict[str, Any]], item_id: str) -> None:
    """Remember, in `gone`, the place of `item_id` as it is deleted from `items` (the id before it): a client
    that deletes the items it pages through (`for item in ...items.list(): ...items.delete(item.id)`) sends
    the last one deleted as the next page's `after`, which was a 400 "no item with id" half way."""
    at = next(i for i, item in enumerate(items) if item.get("id") == item_id)
    gone[item_id] = items[at - 1].get("id") if at else None
    for old in list(gone)[:-MAX_GONE]:
        del gone[old]
