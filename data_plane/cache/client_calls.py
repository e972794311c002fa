"""One call from the gateway's session store (data_plane/cache/client.py) to one cache node: read, write or
remove a record, never raising for the node's failure (a breaker skips a node that keeps failing,
data_plane/cache/client_circuits.py).

    kind, transcript = await store._fetch(member, "sess-1")      # hit | miss | unreadable | error
    result = await store._put(member, transcript, ttl_s=3600, keep_updated_at=True)   # WriteResult
    removed = await store._remove_copy(member, "sess-1", version=4)   # only that version, else kept
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from opentelemetry import propagate

from data_plane.cache.client_circuits import CircuitHops, SkippedNode
from data_plane.cache.client_values import RecordLimits, WriteResult, json_or_none, put_body
from data_plane.cache.model import MAX_RECORD_BYTES, Transcript
from data_plane.common.crypto import SealError, TranscriptSealer
from data_plane.routing.hop_client import HopError

if TYPE_CHECKING:
    from data_plane.membership.view import Member

log = logging.getLogger("data_plane.cache.client")


class NodeCalls:
    """The wire calls of :class:`~data_plane.cache.client.SessionStore` to one node at a time."""

    _http: CircuitHops
    _prefix: str
    _auth: dict[str, str]
    _timeout_s: float
    _sealer: TranscriptSealer | None
    _limits: RecordLimits

    def _path(self, session_id: str) -> str:
        return f"{self._prefix}/{session_id}"  # the id is validated: URL-safe characters only

    def _headers(self) -> dict[str, str]:
        headers: dict[str, str] = dict(self._auth)
        propagate.inject(headers)
        return headers

    async def _fetch(self, member: Member, session_id: str) -> tuple[str, Transcript | None]:
        """('hit', t) | ('miss', None) | ('unreadable', None) | ('error', None); never raises for
        a node's failure. Unreadable: a sealed record that does not open for this session and owner
        (moved, tampered, or an unknown key): to the caller it does not exist."""
        try:
            resp = await self._http.request("GET", member.url, self._path(session_id), headers=self._headers(),
                                            timeout=self._timeout_s)
            raw = await resp.read(self._deadline(), limit=MAX_RECORD_BYTES)
            if resp.status == 404:
                return "miss", None
            if resp.status != 200:
                log.warning("cache node %s answered GET with %d", member.id, resp.status)
                return "error", None
            transcript = Transcript.from_wire(json.loads(raw))
            if transcript.session_id != session_id:
                raise ValueError("cache node returned another session")
            if self._sealer is not None:
                try:
                    opened = self._sealer.open(session_id, transcript.owner, transcript.messages)
                except SealError as exc:
                    log.warning("cache node %s holds an unreadable record for a session: %s", member.id, exc)
                    return "unreadable", None
                transcript = replace(transcript, messages=tuple(opened))
            return "hit", transcript
        except (HopError, ValueError) as exc:
            if not isinstance(exc, SkippedNode):  # that one is logged when its breaker opens
                log.warning("cache node %s unreachable for GET: %s", member.id, type(exc).__name__)
            return "error", None

    async def _put(
        self, member: Member, t: Transcript, ttl_s: float | None, *, keep_updated_at: bool, only_newer: bool = False
    ) -> WriteResult:
        body = put_body(self._sealer, t, ttl_s, keep_updated_at=keep_updated_at, only_newer=only_newer)
        try:
            resp = await self._http.request("PUT", member.url, self._path(t.session_id), body,
                                            headers=self._headers(), timeout=self._timeout_s)
            raw = await resp.read(self._deadline())
        except HopError as exc:
            if not isinstance(exc, SkippedNode):
                log.warning("cache node %s unreachable for PUT: %s", member.id, type(exc).__name__)
            return WriteResult("error")
        if resp.status == 200:
            return WriteResult("ok", 200)
        payload = json_or_none(raw)
        if resp.status == 409:
            stored = None
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                stored = payload["error"].get("stored_version")
            return WriteResult("stale", 409, payload, stored if isinstance(stored, int) else None)
        if resp.status == 413:  # past its limit: a later record this large is refused before it is generated
            self._limits.refused(member.id, len(body), resp)
        if 400 <= resp.status < 500:
            return WriteResult("rejected", resp.status, payload)
        log.warning("cache node %s answered PUT with %d", member.id, resp.status)
        return WriteResult("error", resp.status, payload)

    async def _delete_one(self, member: Member, session_id: str) -> bool:
        try:
            resp = await self._http.request("DELETE", member.url, self._path(session_id), headers=self._headers(),
                                            timeout=self._timeout_s)
            body = json_or_none(await resp.read(self._deadline()))
        except HopError:
            return False
        return resp.status == 200 and isinstance(body, dict) and bool(body.get("deleted"))

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._timeout_s


    async def _remove_copy(self, member: Member, session_id: str, version: int) -> str:
        """Remove `member`'s copy of `session_id` if it still holds `version` (a node that took the record while
        its home node was away, once the record is back on its replicas): removed | kept (the node holds another
        version now: a write that landed since, left alone) | gone | error."""
        try:
            # a path, not ?if_version=N: a node of before conditional deletes ignored the query and removed the
            # record whatever its version; it refuses this path (400: kept, "error")
            resp = await self._http.request("DELETE", member.url, f"{self._path(session_id)}/if-version/{version}",
                                            headers=self._headers(), timeout=self._timeout_s)
            body = json_or_none(await resp.read(self._deadline()))
        except HopError:
            return "error"
        if resp.status != 200 or not isinstance(body, dict):
            return "error"
        if body.get("deleted"):
            return "removed"
        return "kept" if isinstance(body.get("stored_version"), int) else "gone"
