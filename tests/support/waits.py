"""Waiting in tests for a condition instead of sleeping: poll until true or fail with what was awaited.

    took = eventually(lambda: health(gw)["shards"] == 2, timeout_s=5, what="two shards")
    await eventually_async(lambda: view.members() != [], timeout_s=5)     # predicate may be async

Connection errors, missing keys and unparsable values count as "not yet"; the last one is named
when the wait fails. Both return the seconds the condition took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

NOT_YET = (httpx.HTTPError, KeyError, ValueError, IndexError)
"""What a predicate may raise while the thing it polls is not there yet."""


def _failed(what: str, timeout_s: float, last: BaseException | None,
            detail: Callable[[], str] | None) -> AssertionError:
    tail = f" (last error: {last!r})" if last is not None else ""
    more = f"\n{detail()}" if detail is not None else ""
    return AssertionError(f"{what or 'condition'} not met within {timeout_s} s{tail}{more}")


def eventually(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05, what: str = "",
               detail: Callable[[], str] | None = None) -> float:
    """Poll `predicate` until it is truthy; seconds it took. `detail()` is added to the failure
    (e.g. a process's log tail)."""
    start = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except NOT_YET as e:
            last = e
        if time.monotonic() - start > timeout_s:
            raise _failed(what, timeout_s, last, detail)
        time.sleep(interval_s)


async def eventually_async(predicate: Callable[[], Any | Awaitable[Any]], timeout_s: float,
                           interval_s: float = 0.02, what: str = "", detail: Callable[[], str] | None = None) -> float:
    """:func:`eventually` on an event loop; `predicate` may return an awaitable."""
    start = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            result = predicate()
            if isinstance(result, Awaitable):
                result = await result
            if result:
                return time.monotonic() - start
        except NOT_YET as e:
            last = e
        if time.monotonic() - start > timeout_s:
            raise _failed(what, timeout_s, last, detail)
        await asyncio.sleep(interval_s)
