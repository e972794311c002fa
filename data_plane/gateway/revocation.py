"""Ending the requests of a revoked API key: what a key had in flight stops when the key does.

    inflight = InFlightKeys(metrics)                        # one per gateway (data_plane/gateway/runtime.py)
    hold = inflight.hold(key_digest(key), request_id)       # at authentication, in the request's own task
    with hold.interruptible(Stage.OPENING):                 # body, rate limit, queue, shard: a revoke -> 401
        stream = await open_the_stream()
    stream = RevocableSource(stream, hold)                  # a revoke ends the reply: 401 / an SSE error event
    hold.release()                                          # once, when the request ends (Exchange.close)

    inflight.reloaded(old_keys, new_keys)                   # the keys file reloaded: gone keys' requests end

Why: removing a key from the keys file (`switchboard keys revoke`, data_plane/gateway/keys_cli.py) made
new requests with it 401 within a second (data_plane/gateway/keys_file.py), but whatever it had already
opened ran on: streams of hundreds of tokens for minutes, background responses to their end. An operator
revoking a leaked or abusive key expects its use to stop now.

How: every generation request (chat, Responses, background runs: all of data_plane/gateway/chat.py's
path) holds an `InFlight` under its key's digest while it runs. When a reload puts keys in force that
lack a digest (the key revoked, its tenant removed), each of its holds is revoked: a request awaiting
something interruptible (its body, the rate limiter, the admission queue, a shard's first token, the next
tokens) has its task cancelled, and the cancellation is turned into :class:`KeyRevoked` (401
``invalid_api_key``) right there; a request doing anything else (writing to a slow client, saving a
turn) has its shard stream closed at once and meets the revocation at its next interruptible wait. So the
chat path's own error handling answers it: a 401 before the reply's first byte, an SSE error event and
``[DONE]`` after it (the Responses API's ``error`` and ``response.failed``; a background response stored
``failed``); the shard stream is closed, which aborts the generation at the shard's next step; the usage
generated so far is what the Exchange records in the ledger. The cancellation lands only inside an interruptible wait, never in the client's
socket write, so a revocation is never mistaken for a client that left.

Counted in ``switchboard_gateway_requests_revoked_total{stage}`` and logged with the request id and the
key id (never a prompt).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType

from prometheus_client import Counter

from data_plane.common.errors import AuthenticationError
from data_plane.gateway.auth import KEY_ID_LENGTH, KeyStore
from data_plane.gateway.stream import EventSource
from data_plane.membership.view import Member
from data_plane.routing.upstream import Event

log = logging.getLogger(__name__)

REVOKED_MESSAGE = "the API key was revoked while this request was in progress"


class Stage(enum.StrEnum):
    """Where a request was when its key's revocation ended it (the metric's bounded `stage` label)."""

    OPENING = "opening"
    """Before the reply began: reading the body, rate limit, admission queue, session, a shard's first token."""
    REPLYING = "replying"
    """While the reply was generated (streamed, or collected into one body)."""


class KeyRevoked(AuthenticationError):
    """The request's API key was revoked while it ran (401 ``invalid_api_key``)."""

    def __init__(self) -> None:
        super().__init__(REVOKED_MESSAGE)


class InFlight:
    """One request's hold under its key's digest (see the module docstring). Created in the request's
    task, which `revoke` may cancel while it is inside `interruptible`."""

    def __init__(self, owner: InFlightKeys, digest: str, request_id: str) -> None:
        self._owner = owner
        self.digest = digest
        self.request_id = request_id
        self.revoked = False
        self._task = asyncio.current_task()
        self._armed = 0
        self._cancelled = False
        """This hold cancelled the task and the cancellation has not been turned into KeyRevoked yet."""
        self._blocks = {stage: _Interruptible(self, stage) for stage in Stage}
        self.upstream: Callable[[], None] | None = None
        """Closes the reply's shard stream (set by RevocableSource): a revocation that finds the request
        busy elsewhere (a slow client's socket) still stops the shard's work at once."""

    def interruptible(self, stage: Stage) -> _Interruptible:
        """A ``with`` block that a revocation ends at once with KeyRevoked (also raised on entry when the key
        was revoked before). Any other cancellation (the client left, the server stops) passes."""
        return self._blocks[stage]

    def revoke(self) -> None:
        """The key is gone: end the request now if it waits inside `interruptible`, else at its next wait."""
        if self.revoked:
            return
        self.revoked = True
        task = self._task
        if self._armed and task is not None and not task.done():
            self._cancelled = True
            task.cancel()
        elif self.upstream is not None:
            self.upstream()  # synchronous; the request ends at its next wait for tokens

    def release(self) -> None:
        """The request ended (idempotent)."""
        self._owner.discard(self)

    def _ended(self, stage: Stage) -> KeyRevoked:
        self._owner.count(stage)
        log.info("request %s: ended, its API key %s was revoked (%s)", self.request_id,
                 self.digest[:KEY_ID_LENGTH], stage.value)
        return KeyRevoked()


class _Interruptible:
    """`InFlight.interruptible`: a class, not a generator, as the reply enters it once per batch of tokens."""

    __slots__ = ("_hold", "_stage")

    def __init__(self, hold: InFlight, stage: Stage) -> None:
        self._hold = hold
        self._stage = stage

    def __enter__(self) -> None:
        hold = self._hold
        if hold.revoked:
            raise hold._ended(self._stage)
        hold._armed += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        hold = self._hold
        hold._armed -= 1
        if not hold._cancelled:
            return
        # This block was cancelled for the revocation: whatever came of it (the CancelledError, or what the
        # code inside turned it into), the request ends with KeyRevoked; unless someone else cancelled the
        # task too (the client left, the server stops): theirs goes on.
        hold._cancelled = False
        task = hold._task
        if task is not None and task.uncancel() == 0:
            raise hold._ended(self._stage) from None


class InFlightKeys:
    """The gateway's generation requests in flight, by key digest: the one registry a revocation reads."""

    def __init__(self, revoked: Counter) -> None:
        self._revoked = revoked
        self._by_digest: dict[str, set[InFlight]] = {}
        for stage in Stage:
            revoked.labels(stage.value)

    def hold(self, digest: str, request_id: str) -> InFlight:
        """Register the calling task's request under `digest` until its `release`."""
        hold = InFlight(self, digest, request_id)
        self._by_digest.setdefault(digest, set()).add(hold)
        return hold

    def discard(self, hold: InFlight) -> None:
        holds = self._by_digest.get(hold.digest)
        if holds is None:
            return
        holds.discard(hold)
        if not holds:
            del self._by_digest[hold.digest]

    def count(self, stage: Stage) -> None:
        self._revoked.labels(stage.value).inc()

    def revoke(self, digests: set[str]) -> int:
        """End every request held under these digests; how many there were."""
        ended = 0
        for digest in sorted(digests & self._by_digest.keys()):
            holds = list(self._by_digest.get(digest, ()))
            log.warning("API key %s revoked: ending its %d request(s) in flight", digest[:KEY_ID_LENGTH], len(holds))
            for hold in holds:
                hold.revoke()
            ended += len(holds)
        return ended

    def reloaded(self, old: KeyStore, new: KeyStore) -> int:
        """New keys are in force: end the requests of every key `old` had and `new` lacks."""
        return self.revoke(set(old.by_digest()) - set(new.by_digest()))

    def __len__(self) -> int:
        return sum(len(holds) for holds in self._by_digest.values())


class RevocableSource:
    """A reply's event source (data_plane/gateway/stream.py EventSource) that a revocation ends: waiting
    for the next tokens is interruptible, so KeyRevoked comes out of `batches` and the Completion answers
    it as any failure mid-reply (and closes this source, which aborts the shard's generation)."""

    def __init__(self, inner: EventSource, hold: InFlight) -> None:
        self._inner = inner
        self._hold = hold
        self.member: Member = inner.member
        hold.upstream = inner.close

    async def batches(self) -> AsyncIterator[list[Event]]:
        batches = aiter(self._inner.batches())
        while True:
            with self._hold.interruptible(Stage.REPLYING):
                try:
                    events = await anext(batches)
                except StopAsyncIteration:
                    return
            yield events

    def close(self) -> None:
        self._inner.close()


__all__ = ["REVOKED_MESSAGE", "InFlight", "InFlightKeys", "KeyRevoked", "RevocableSource", "Stage"]
