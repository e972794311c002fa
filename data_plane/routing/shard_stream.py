"""An open, supervised stream from one shard, after its first token (opened by data_plane/routing/upstream.py).

    stream = await upstream.open(request, session_id)
    async for events in stream.batches(): ...
    stream.lose()          # its shard left membership: fails over unless the shard is still sending

A failure mid-way raises :class:`UpstreamError` / :class:`UpstreamTimeout` from ``batches()`` with
``failure`` set (a FailureReason, held against the shard unless the shard's own error event says the
request caused it); the resumable stream of upstream.py then continues on another shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack

from data_plane.common.errors import SwitchboardError, UpstreamError, UpstreamTimeout
from data_plane.membership.view import Member
from data_plane.routing import events as wire
from data_plane.routing.events import Event
from data_plane.routing.failures import FailureReason
from data_plane.routing.hop_client import HopDisconnected, HopError, HopTimeout
from data_plane.routing.router import Router
from data_plane.routing.transport import ShardResponse

log = logging.getLogger(__name__)

LOSS_GRACE_S = 0.75
"""How long a stream whose shard left membership may go on without a byte from it before it fails over:
above the shards' keep-alive interval (0.5 s), so a live shard always sends something within it."""


def loss_grace(keepalive_s: str | None) -> float:
    """The grace for a shard announcing keep-alives every `keepalive_s` (its registration meta): 1.5 of
    its intervals, at least LOSS_GRACE_S."""
    try:
        return max(LOSS_GRACE_S, 1.5 * float(keepalive_s or 0))
    except ValueError:
        return LOSS_GRACE_S


class ShardStream:
    """An open, supervised stream from one shard; iterate `batches()` for the events after the
    first batch: every event that has arrived, at once."""

    def __init__(self, member: Member, response: ShardResponse, first: list[Event], leases: ExitStack,
                 router: Router, idle_timeout_s: float, attempts: int) -> None:
        self.member = member
        self.attempts = attempts
        self._response = response
        self._pending = first
        self._leases = leases
        self._router = router
        self._idle = idle_timeout_s
        self._closed = False
        self._lost = False
        self._data_at = time.monotonic()
        """When the shard last sent anything (a token, a keep-alive)."""
        self._suspect: asyncio.TimerHandle | None = None
        self.failure: FailureReason | None = None
        """Why the stream broke mid-way (None while it has not)."""
        self.on_close: Callable[[ShardStream], None] | None = None

    def lose(self, grace_s: float = LOSS_GRACE_S) -> None:
        """The shard left membership (critical or gone) mid-stream: unless it sends something within
        `grace_s`, fail the stream then, so it resumes elsewhere instead of waiting for silence.

        Why the grace: a shard's heartbeat late by 100 ms on a busy host (the registry's TTL is 0.8 s)
        made it critical for a moment while it kept streaming; its streams were failed at once, and
        when the other shards were critical or loading at that moment too, the clients got "the shard
        left membership mid-stream" from a healthy shard (2 streams of ~200 in 25 minutes of a 2-core
        `switchboard up`, with no process dying). A frozen or cut-off shard sends nothing, keep-alives
        included, and still fails over here, sooner than the silence timeout."""
        if self._closed or self._lost or self._suspect is not None:
            return
        noticed = time.monotonic()
        self._suspect = asyncio.get_running_loop().call_later(grace_s, self._confirm_lost, noticed)

    def _confirm_lost(self, noticed: float) -> None:
        self._suspect = None
        if self._closed or self._lost or self._data_at > noticed:  # it kept streaming: alive after all
            return
        self._lost = True
        log.warning("shard %s left membership mid-stream and sent nothing for %.2f s; resuming elsewhere",
                    self.member.id, time.monotonic() - noticed)
        self._response.fail(HopDisconnected("the shard left membership"))

    async def batches(self) -> AsyncIterator[list[Event]]:
        if self._pending:
            first, self._pending = self._pending, []
            yield first
        try:
            while True:
                try:
                    lines = await self._response.lines(self._idle)
                except HopTimeout:
                    self._fail(FailureReason.STREAM_IDLE)
                    raise UpstreamTimeout(f"the shard stopped streaming for {self._idle:g} s") from None
                except HopError as exc:
                    if self._lost:
                        self._fail(FailureReason.MEMBERSHIP_LOST)
                        raise UpstreamError("the shard left membership mid-stream") from None
                    self._fail(FailureReason.STREAM_BROKEN)
                    raise UpstreamError(f"the shard's stream broke: {exc}") from None
                self._data_at = time.monotonic()
                if not lines:
                    return
                events: list[Event] = []
                for line in lines:
                    parsed = wire.parse_line(line)
                    if isinstance(parsed, SwitchboardError):
                        self.failure = FailureReason.for_stream_error(parsed.code)  # not held against the shard
                        if events:
                            yield events
                        raise parsed
                    events.extend(parsed)
                if events:
                    yield events
        finally:
            self.close()

    def _fail(self, reason: FailureReason) -> None:
        self.failure = reason
        self._router.report_failure(self.member, reason)

    def close(self) -> None:
        """Idempotent. A stream not read to its end drops the connection: the shard aborts."""
        if self._closed:
            return
        self._closed = True
        if self._suspect is not None:
            self._suspect.cancel()
        try:
            self._response.close()
        finally:
            self._leases.close()
            if self.on_close is not None:
                self.on_close(self)


__all__ = ["LOSS_GRACE_S", "ShardStream", "loss_grace"]
