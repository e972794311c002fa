"""What :class:`~data_plane.routing.upstream.Upstream` needs from the hop client: two small protocols.

    upstream = Upstream(router, HopPool(), config)      # HopPool is a ShardTransport
    upstream = Upstream(router, ScriptedPool(...), config)   # so is a test's scripted pool, no ignores

The one implementation is :class:`~data_plane.routing.hop_client.HopPool` (its ``HopResponse``); the
only fakes sit here, at the transport boundary (tests/data_plane/test_upstream.py).
"""

from __future__ import annotations

from typing import Protocol

from data_plane.routing.hop_client import HopError


class ShardResponse(Protocol):
    """A shard's answer whose status and headers have arrived (:class:`~data_plane.routing.hop_client.HopResponse`)."""

    status: int

    def header(self, name: bytes, /) -> bytes | None: ...

    async def read(self, deadline: float = ..., /) -> bytes: ...

    async def lines(self, timeout: float = ..., /) -> list[bytes]: ...

    def fail(self, error: HopError, /) -> None: ...

    def close(self) -> None: ...


class ShardTransport(Protocol):
    """How :class:`Upstream` reaches a shard (:class:`~data_plane.routing.hop_client.HopPool`; tests
    script one). ``post`` returns once the headers arrived; it raises HopConnectError, HopTimeout (no
    headers within `timeout` s) or another HopError."""

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str] | None = ..., /,
                   timeout: float = ...) -> ShardResponse: ...


__all__ = ["ShardResponse", "ShardTransport"]
