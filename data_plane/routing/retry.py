"""Retry before the first token, kept apart from building and sending the request.

    stream = await with_retries(attempt, 1 + config.retries, on_retry=record)

``attempt(n)`` makes the n-th try and raises :class:`Retryable` for a failure another shard may not
have; `on_retry` runs before each further try (metric, span event, log line); when every try failed,
the last failure's client-facing error is raised. Anything else an attempt raises ends the loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from data_plane.common.errors import SwitchboardError
from data_plane.membership.view import Member
from data_plane.routing.failures import FailureReason


class Retryable(Exception):
    """A failure before the first token that another shard may not have: `reason` is what is counted
    and held against the shard, `error` what the client gets if no attempt succeeds."""

    def __init__(self, reason: FailureReason, error: SwitchboardError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error
        self.member: Member | None = None


T = TypeVar("T")


async def with_retries(attempt: Callable[[int], Awaitable[T]], attempts: int,
                       on_retry: Callable[[Retryable], None]) -> T:
    """Call ``attempt(1)``, ``attempt(2)``, ... until one returns; a :class:`Retryable` failure is
    retried (`on_retry` first) while attempts remain, anything else ends it. Exhausted: the last
    failure's error."""
    last: Retryable | None = None
    for n in range(1, attempts + 1):
        try:
            return await attempt(n)
        except Retryable as failure:
            last = failure
            if n < attempts:
                on_retry(failure)
    assert last is not None
    raise last.error


__all__ = ["Retryable", "with_retries"]
