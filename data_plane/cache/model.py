"""The cache tier's wire contract: what a transcript is, which session ids are valid, what a stale write gets.

    t = Transcript.from_wire(body)          # ValueError if the body is not a transcript
    validate_session_id("sess-1")           # InvalidRequest (400) if the id is not acceptable
    raise VersionConflict("...", stored_version=4)   # 409 with the stored version in the body

Both sides of the hop import it: the gateway's client (data_plane/cache/client.py) and the cache
node (data_plane/cache/node.py, data_plane/cache/storage.py), so the node never imports the client.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from data_plane.common.errors import InvalidRequest, SwitchboardError

SESSION_ID_PATTERN = r"[A-Za-z0-9_.:-]{1,128}"
"""Session ids the cache tier accepts (whole-string match)."""
_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)
MAX_RECORD_BYTES = 256 * 1024 * 1024
"""The largest session record a cache node may hold (its --max-body-bytes ceiling)."""
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def validate_session_id(session_id: str) -> str:
    """Return `session_id` if the cache tier accepts it, else raise InvalidRequest (400)."""
    if not isinstance(session_id, str) or not _SESSION_ID_RE.fullmatch(session_id):
        raise InvalidRequest(
            "session id must be 1-128 characters of A-Z a-z 0-9 _ . : -",
            param="session_id",
            code="invalid_session_id",
        )
    return session_id


class VersionConflict(SwitchboardError):
    """A write older than the stored record (409); the body carries ``stored_version``."""

    status = 409
    type = "invalid_request_error"
    code = "session_version_conflict"

    def __init__(self, message: str, *, stored_version: int, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.stored_version = stored_version

    def body(self, request_id: str | None = None, trace_id: str | None = None) -> dict[str, Any]:
        out = super().body(request_id, trace_id)
        out["error"]["stored_version"] = self.stored_version
        return out


LIMIT_META = "max_body_bytes"
"""A cache node's membership meta: the largest record write (its PUT body, in bytes) it takes (--max-body-bytes)."""
LIMIT_HEADER = "X-Max-Body-Bytes"
"""The same, on a node's 413 to a record write past it (a node listed by URL has no meta to read)."""
TOMBSTONE_VERSION = 2**53 - 1
"""The version of a deleted record's tombstone (the highest a node accepts): as nodes keep the highest
version, no older copy (a replica that was down during the delete, a late read-repair) can be
written over it, and read-repair spreads the tombstone itself. It holds no messages."""


@dataclass(frozen=True)
class Transcript:
    """One session's whole transcript, as stored on a cache node and returned by ``load``."""

    session_id: str
    owner: str
    messages: tuple[Mapping[str, str], ...]
    version: int
    updated_at: float
    expires_at: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "owner": self.owner,
            "messages": [dict(m) for m in self.messages],
            "version": self.version,
            "updated_at": self.updated_at,
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Transcript:
        """Parse a cache node's GET body; ValueError if it is not a transcript."""
        if not isinstance(data, dict):
            raise ValueError("transcript must be an object")
        try:
            messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"])
            version = data["version"]
            if not isinstance(version, int) or isinstance(version, bool):
                raise ValueError("version must be an integer")
            expires_at = data.get("expires_at")
            return cls(
                session_id=str(data["session_id"]),
                owner=str(data["owner"]),
                messages=messages,
                version=version,
                updated_at=float(data["updated_at"]),
                expires_at=None if expires_at is None else float(expires_at),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed transcript: {exc!r}") from None

    @property
    def deleted(self) -> bool:
        """A tombstone (:data:`TOMBSTONE_VERSION`): the record was deleted."""
        return self.version >= TOMBSTONE_VERSION

    def ttl_left(self, now: float) -> float | None:
        """Seconds until expiry (None: the node's default applies)."""
        return None if self.expires_at is None else self.expires_at - now
