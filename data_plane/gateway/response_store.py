"""Responses and conversations kept as sessions on the cache nodes: one conversation store.

    store = ConversationStore(runtime.sessions, ttl_s=86400)
    rec = await store.load("resp_...", owner, replicas=2, kind=Kind.RESPONSE)   # 404 if not this key's
    rec = await store.previous("resp_...", owner, replicas=2)   # a previous_response_id: 400 if not this key's
    await store.save(rec, owner, replicas=2)
    await store.delete("conv_...", owner, replicas=2, kind=Kind.CONVERSATION)     # from every cache node

A stored response and a conversation are each one session record (data_plane/cache/client.py): sealed
with the key it belongs to, replicated like any session of the tier, read-repaired, and bound to the
API key that made it (another key's id is a 404, exactly like a missing one; named as a
`previous_response_id`, the 400 of `previous`). The record's single message (role ``x-responses``)
holds the Responses API's own state as JSON: the items so far (the conversation as the model sees it:
messages, function calls, their outputs, compaction items), the response object or the conversation's
metadata, and ``route``: the session id the chain's generations run under (the first response's id, or
the conversation's), so every turn of a chain reaches the shard and the cache nodes that hold its KV
blocks (kv_aware routing).

A response record holds the whole chain up to it (copy on write): `previous_response_id` may point
at any earlier response and branch from there, and a turn costs one cache read, not one per turn.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from data_plane.cache.client import SessionStore
from data_plane.cache.model import TOMBSTONE_VERSION, VersionConflict, validate_session_id
from data_plane.common.errors import InvalidRequest, NotFound, SwitchboardError, clipped
from data_plane.gateway.record_locks import locked_error

META_ROLE = "x-responses"
"""The role of the one message a Responses record holds (never sent to a model)."""


class Kind(str, enum.Enum):
    RESPONSE = "response"
    CONVERSATION = "conversation"
    CHAT_COMPLETION = "chat.completion"
    """A stored chat completion (data_plane/gateway/chat_store.py): `response` the completion object,
    `items` its request messages."""
    CHAT_INDEX = "chat.completion.index"
    """One owner's list of stored chat completions (`items`: id, created, model, metadata), for listing."""
    ITEM_INDEX = "item.index"
    """Where one stored item of an owner lives (`items`: the records holding it), for `item_reference`
    inputs (data_plane/gateway/item_index.py)."""


@dataclass
class Record:
    """One stored response or conversation."""

    id: str
    kind: Kind
    items: list[dict[str, Any]]
    """Every item of the conversation so far, oldest first."""
    route: str
    """The session id generations of this chain/conversation run under (routing and KV)."""
    version: int = 0
    response: dict[str, Any] | None = None
    """kind RESPONSE: the response object as GET returns it."""
    input_range: tuple[int, int] = (0, 0)
    """kind RESPONSE: items[start:end] were this response's input."""
    conversation: dict[str, Any] = field(default_factory=dict)
    """kind CONVERSATION: id, created_at, metadata."""
    deadline: float = 0.0
    """A background response stored unfinished (queued, in_progress): the wall-clock time by which its
    gateway ends it; past it, a reader knows that gateway is gone (data_plane/gateway/responses_background.py)."""
    stored_bytes: int = 0
    """The UTF-8 length of the record as it was loaded (not stored): what bounds the size of its next write."""

    def to_message(self) -> dict[str, str]:
        body: dict[str, Any] = {"kind": self.kind.value, "items": self.items, "route": self.route, "response": self.response,
                "input_range": list(self.input_range), "conversation": self.conversation}
        if self.deadline:
            body["deadline"] = self.deadline
        return {"role": META_ROLE, "content": json.dumps(body, ensure_ascii=False, separators=(",", ":"))}

    @classmethod
    def from_messages(cls, record_id: str, messages: Any, version: int) -> Record | None:
        if len(messages) != 1 or messages[0]["role"] != META_ROLE:
            return None  # a chat session (X-Session-Id), not a Responses record
        body = json.loads(messages[0]["content"])
        start, end = body.get("input_range") or (0, 0)
        return cls(record_id, Kind(body["kind"]), body["items"], body["route"], version, body.get("response"),
                   (start, end), body.get("conversation") or {}, float(body.get("deadline") or 0.0),
                   len(messages[0]["content"].encode()))


def not_found(kind: Kind, record_id: str) -> NotFound:
    """OpenAI's 404 for a response, conversation or chat completion this caller cannot see."""
    name, param = _NAMES.get(kind, ("Chat completion", "completion_id"))
    return NotFound(f"{name} with id '{clipped(record_id)}' not found.", param=param, code="not_found")


_NAMES = {Kind.RESPONSE: ("Response", "response_id"), Kind.CONVERSATION: ("Conversation", "conversation_id")}


class ConversationStore:
    """Loads, saves and deletes Responses records on the session store (see the module docstring)."""

    def __init__(self, sessions: SessionStore, ttl_s: float) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self._tasks: set[asyncio.Task[None]] = set()

    def later(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` off the request path (a background compaction), tracked until `aclose`."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def load(self, record_id: str, owner: str, replicas: int, kind: Kind) -> Record:
        try:
            validate_session_id(record_id)
            transcript = await self.sessions.load(record_id, owner, replicas,  # an index may not exist yet
                                                  expected=kind not in (Kind.CHAT_INDEX, Kind.ITEM_INDEX))
        except SwitchboardError as exc:
            if exc.status in (400, 404):
                raise not_found(kind, record_id) from None
            raise
        record = None if transcript is None else Record.from_messages(record_id, transcript.messages,
                                                                      transcript.version)
        if record is None or record.kind is not kind:
            raise not_found(kind, record_id)
        return record

    async def previous(self, response_id: str, owner: str, replicas: int) -> Record:
        """The response a request's `previous_response_id` names, or OpenAI's 400 for it:
        ``previous_response_not_found``, param ``previous_response_id``, "Previous response with id '...' not
        found." (unknown, deleted, `store: false`, another key's, or out of this zone). Not the 404 that
        GET /v1/responses/{id} is: clients that chain turns read that code to start the chain again with the
        whole history (pydantic-ai's `openai_previous_response_id="auto"`, Codex's bridges), and the 404
        left them with a dead chain. One still queued or in progress is a 400 on `previous_response_id` too
        (`unfinished`)."""
        try:
            record = await self.load(response_id, owner, replicas, Kind.RESPONSE)
        except NotFound:
            raise InvalidRequest(f"Previous response with id '{clipped(response_id)}' not found.",
                                 param="previous_response_id", code="previous_response_not_found") from None
        if unfinished(record):
            raise InvalidRequest(f"Previous response with id '{clipped(response_id)}' is still "
                                 f"{str((record.response or {}).get('status')).replace('_', ' ')}: wait for it to complete, then send this request "
                                 "again.", param="previous_response_id")
        return record

    async def save(self, record: Record, owner: str, replicas: int) -> None:
        """Write `record` as its next version. A conversation deleted since it was loaded (its tombstone
        outranks every write) is OpenAI's 404 for it, not the cache's 409 on a ``version`` the client never
        sent: a turn or an item edit racing the delete. (A response's writer, the background run, reads
        that 409 itself: its delete stands as a cancel, data_plane/gateway/responses_detached.py.)"""
        record.version += 1
        conversation = record.kind is Kind.CONVERSATION
        try:  # only_newer: another gateway's turn or edit on this version got there first (record_locks.py)
            await self.sessions.save(record.id, owner, [record.to_message()], record.version, replicas,
                                     ttl_s=self.ttl_s, only_newer=conversation)
        except VersionConflict as exc:
            if conversation and exc.stored_version >= TOMBSTONE_VERSION:
                raise not_found(record.kind, record.id) from None
            if conversation:
                raise locked_error("conversation") from None
            raise

    def check_fits(self, record: Record, owner: str, replicas: int, rough: int) -> None:
        """400 ``record_too_large`` at once when no cache node of `record` would store it (a turn's record with
        its input, before its reply: data_plane/cache/client_values.py RecordLimits), not after its generation.
        `rough`: at least its UTF-8 length (the record as loaded and what is added): it is encoded only near a limit."""
        self.sessions.check_fits(record.id, owner, lambda: [record.to_message()], replicas, rough)

    async def delete(self, record_id: str, owner: str, replicas: int, kind: Kind) -> None:
        await self.load(record_id, owner, replicas, kind)  # 404 unless it is this key's and of this kind
        await self.sessions.delete(record_id, owner, replicas)


def new_conversation(conv_id: str, items: list[dict[str, Any]], metadata: dict[str, str] | None) -> Record:
    return Record(conv_id, Kind.CONVERSATION, items, conv_id,
                  conversation={"id": conv_id, "created_at": int(time.time()), "metadata": metadata or {}})


def conversation_object(record: Record) -> dict[str, Any]:
    c = record.conversation
    return {"id": record.id, "object": "conversation", "created_at": c.get("created_at", 0),
            "metadata": c.get("metadata") or {}}


def unfinished(record: Record) -> bool:
    """A response still ``queued`` or ``in_progress`` (a background run, a stream) whose deadline has not passed:
    its record holds its input and none of its output yet. A `previous_response_id` naming it went on from that
    input, silently leaving out the reply it was still making; it is a 400 now (no word from OpenAI on it: the
    safe answer). Past its deadline its gateway is gone and it reads as failed: a chain goes on from its input."""
    status = (record.response or {}).get("status")
    return status in ("queued", "in_progress") and not (record.deadline and time.time() > record.deadline)
