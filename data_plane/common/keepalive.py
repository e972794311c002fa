"""SSE keep-alives: a streaming hop that goes silent is a failed hop, found in ~2 s instead of 30.

    async for item in with_keepalives(engine.generate(req), interval_s=0.5):
        yield KEEPALIVE_COMMENT if item is None else encode(item)      # the shard's SSE writer

A shard (data_plane/shard/app.py) writes the SSE comment ``: keep-alive`` whenever its engine has
produced nothing for ``interval_s`` — while the request waits in the queue, during a long
prefill, between slow tokens — and announces ``keepalive_s`` in its membership meta. The
gateway (data_plane/routing/upstream.py) then knows that silence from that shard means the host, the
process or the network is gone (a gateway without the meta, routing to ``--shard-urls``, reads
the stream's ``x-switchboard-keepalive-s`` header instead): after ``silence_timeout_s`` (2 s by default, a
few keep-alive intervals) it fails the attempt over to another shard, before the first token as a retry and
mid-stream as a resume. A shard that announces nothing (vLLM's own server, any other
OpenAI-compatible engine) keeps the long first-token and idle timeouts.

Comments are ignored by every SSE client, the ``openai`` SDK included, so a client talking to a
shard directly sees the same stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

KEEPALIVE_COMMENT = b": keep-alive\n\n"
KEEPALIVE_META = "keepalive_s"
"""Membership meta key: the interval a shard sends keep-alives at (its absence: none sent)."""
KEEPALIVE_HEADER = "x-switchboard-keepalive-s"
"""The same, as a header of each stream the shard answers: a gateway that knows its shards by URL
(``--shard-urls``, no registry, so no meta) reads it there. Without it a frozen shard held such a gateway's
streams for the 30 s idle timeout, not the 2 s silence timeout."""


def silence_for(interval: str | bytes | None, floor_s: float) -> float | None:
    """How long a shard announcing keep-alives every `interval` seconds (its meta or header value; None or
    empty: it sends none, so None) may send nothing: `floor_s` (the gateway's silence timeout), or three of
    its intervals where those are longer (a shard may send them up to a minute apart)."""
    if not interval:
        return None
    try:
        every = float(interval)
    except ValueError:
        return floor_s
    return max(floor_s, 3 * every)


async def with_keepalives(source: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """Items of `source`, with None whenever `interval_s` passes without one. Closing or cancelling
    the consumer cancels the pending read and closes `source` (so the engine aborts the request)."""
    it = source.__aiter__()
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait((pending,), timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                if pending.done():
                    pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            # The read runs the source in its own task: cancelling it raises CancelledError inside
            # the source at its await, whose own cleanup (the engine's abort) then runs there.
            pending.cancel()
            pending.add_done_callback(_retrieve)
        else:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(aclose())


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # consumed, so a failure during cancellation is not logged as "never retrieved"
