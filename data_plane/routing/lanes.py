"""Resuming a stream of several choices (``n`` > 1) after its shard failed mid-way: one continuation
per unfinished choice, merged back into one stream.

    split = ChoiceLanes(upstream, request, session_id, tried, progress, resumes_left, cause)
    async for events in split.batches(): ...      # indices, usage and finishes as the original stream's

A shard continues one final assistant message (vLLM's `continue_final_message`), so a request of
``n`` choices cannot be continued as one request: each choice has its own text. Each unfinished
choice ``i`` is re-opened on another shard as a request of one choice: the prompt, choice ``i``'s own
output so far as the message to continue (its tool envelope rebuilt, `SentOutput`), and
``max_tokens`` less the tokens choice ``i`` already produced. Their events come back with index ``i``;
a choice that fails again is continued again while the request's resumes last (the split counts as
one resume, each choice that fails again as one more). Greedy choices continue exactly as an
uninterrupted run would (float32); a seeded choice continues with its own seed (the shard gives
choice ``i`` ``seed + i``), as a seeded ``n`` = 1 stream does; an unseeded sampled choice continues as
a sample from where it stopped (a valid continuation, not the one the dead shard would have drawn).
Usage stays the original request's: its prompt once, the completion tokens of every choice summed,
in one final usage event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from data_plane.common.errors import SwitchboardError, UpstreamError, UpstreamTimeout
from data_plane.membership.view import Member
from data_plane.protocol import ChatMessage, ShardRequest
from data_plane.routing.events import (
    Delta,
    Event,
    Fingerprint,
    Finish,
    ToolCallDelta,
    UsageEvent,
    client_error,
    unresumed,
)
from data_plane.routing.failures import FailureReason
from data_plane.routing.router import Router
from data_plane.tool_calls import SentOutput

log = logging.getLogger(__name__)


class ShardStream(Protocol):
    """What a lane reads: data_plane/routing/upstream.py `ShardStream`."""

    member: Member
    failure: FailureReason | None

    def batches(self) -> AsyncIterator[list[Event]]: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    """What opens a lane: data_plane/routing/upstream.py `Upstream` (not imported: it imports this)."""

    router: Router

    async def open(self, request: ShardRequest, session_id: str | None,
                   exclude: set[str] | None = None) -> ShardStream: ...

    async def reopen(self, request: ShardRequest, session_id: str | None, tried: set[str]) -> ShardStream: ...


@dataclass
class Progress:
    """What the client has of each choice: its output (to continue from), its tokens, whether it finished."""

    sent: dict[int, SentOutput] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    """choice -> completion tokens so far (every stream of it)."""
    base: dict[int, int] = field(default_factory=dict)
    """choice -> tokens produced by its earlier, failed streams."""
    finished: set[int] = field(default_factory=set)
    prompt_tokens: int | None = None
    cached_tokens: int = 0

    def output(self, index: int, body: dict[str, object]) -> SentOutput:
        found = self.sent.get(index)
        if found is None:
            found = self.sent[index] = SentOutput.for_body(body)
        return found

    def take(self, event: Event, index: int, body: dict[str, object]) -> Event | None:
        """Record `event` (of choice `index`, whatever index its stream gave it) and return it as the
        client's stream numbers and counts it (None: a usage event, summed at the end instead)."""
        if isinstance(event, Delta):
            self.output(index, body).content(event.text)
            if event.usage is not None:
                if self.prompt_tokens is None:
                    self.prompt_tokens = event.usage[0]
                self.tokens[index] = self.base.get(index, 0) + event.usage[1]
                event = replace(event, usage=(self.prompt_tokens, self.tokens[index]))
            return replace(event, index=index)
        if isinstance(event, ToolCallDelta):
            self.output(index, body).call(event.call, event.name, event.arguments)
            return replace(event, index=index)
        if isinstance(event, Finish):
            self.finished.add(index)
            return replace(event, index=index)
        if isinstance(event, Fingerprint):  # the shard of a lane (a continuation) may say another
            return replace(event, index=index)
        self.cached_tokens = self.cached_tokens or event.cached_tokens
        if self.prompt_tokens is None:
            self.prompt_tokens = event.prompt_tokens
        return None

    def usage(self) -> UsageEvent:
        """The request's usage: its prompt once (a continuation's prompt also holds the output, so its
        cached count is capped at the request's prompt), every choice's tokens summed."""
        prompt = self.prompt_tokens or 0
        return UsageEvent(prompt, sum(self.tokens.values()), min(self.cached_tokens, prompt))


def continued(request: ShardRequest, text: str) -> list[ChatMessage]:
    """The messages that go on with `request`'s reply after `text` (already sent): the final assistant message
    with `text` after it when the request itself continues that message (continue_final_message), else
    `text` as a new assistant message."""
    if request.continue_final_message:
        last = request.messages[-1]
        return [*request.messages[:-1], last.model_copy(update={"content": last.text() + text})]
    return [*request.messages, ChatMessage(role="assistant", content=text)]


class ChoiceLanes:
    """The continuation of a ``n`` > 1 stream, one lane per unfinished choice (see the module docstring)."""

    def __init__(self, upstream: Upstream, request: ShardRequest, session_id: str | None, tried: set[str],
                 progress: Progress, resumes_left: int, cause: SwitchboardError) -> None:
        """`cause`: the failure that broke the stream, raised if no choice can be continued."""
        self._cause = cause
        self._upstream = upstream
        self._request = request
        self._body = request.wire()
        self._session_id = session_id
        self._tried = tried
        self.progress = progress
        self.resumes_left = resumes_left
        self._lanes: dict[int, ShardStream] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._queue: asyncio.Queue[tuple[int, list[Event] | BaseException | None]] = asyncio.Queue()

    async def _open(self, index: int) -> bool:
        """Continue choice `index` on another shard (False: it has no tokens left, it is finished)."""
        p = self.progress
        p.base[index] = p.tokens.get(index, 0)
        remaining = (self._request.max_tokens or 0) - p.base[index]
        if remaining <= 0:
            return False
        seed, rid = self._request.seed, self._request.request_id
        sent = p.output(index, self._body).text()
        request = self._request.model_copy(update={  # choice i's seed is seed + i (data_plane/shard/generation.py)
            "n": 1, "messages": continued(self._request, sent),
            "prompt_logprobs": None if sent else self._request.prompt_logprobs,  # (came on its first chunk)
            "continue_final_message": True,
            "add_generation_prompt": False, "max_tokens": remaining, "seed": None if seed is None else _int64(seed + index),
            # its own id: two choices may continue on one shard, which refuses a second request of one id
            "request_id": None if rid is None else f"{rid[:120]}-lane{index}"})
        stream = await self._upstream.reopen(request, self._session_id, self._tried)
        self._lanes[index] = stream
        self._tasks[index] = asyncio.ensure_future(self._pump(index, stream))
        return True

    async def _pump(self, index: int, stream: ShardStream) -> None:
        """Lane `index`'s events onto the queue, then None; or whatever ended it (never nothing: the
        merge waits on the queue)."""
        try:
            async for events in stream.batches():
                await self._queue.put((index, events))
            await self._queue.put((index, None))
        except Exception as exc:  # noqa: BLE001 -- the merge decides: resume (a shard's failure) or raise
            await self._queue.put((index, exc))

    async def batches(self) -> AsyncIterator[list[Event]]:
        p = self.progress
        try:
            for index in range(self._request.n or 1):
                if index in p.finished:
                    continue
                try:
                    opened = await self._open(index)
                except SwitchboardError as exc:
                    log.warning("choice %d could not be continued elsewhere: %s", index, exc.message)
                    raise unresumed(self._cause) from None
                if not opened:
                    p.finished.add(index)
                    yield [Finish("length", index)]
            while self._tasks:
                index, item = await self._queue.get()
                if item is None:  # the lane's stream ended
                    del self._tasks[index]
                    self._lanes.pop(index).close()
                    continue
                if isinstance(item, BaseException):
                    await self._failed(index, item)
                    if index not in self._tasks and index not in p.finished:  # no tokens left
                        p.finished.add(index)
                        yield [Finish("length", index)]
                    continue
                for event in item:  # a lane's own total: the choice's tokens (its prompt holds the output)
                    if isinstance(event, UsageEvent):
                        p.tokens[index] = p.base.get(index, 0) + event.completion_tokens
                out = [e for e in (p.take(event, index, self._body) for event in item) if e is not None]
                if out:
                    yield out
            yield [p.usage()]
        finally:
            self.close()

    async def _failed(self, index: int, exc: BaseException) -> None:
        """Lane `index` broke: continue that choice once more elsewhere, or end the stream with `exc`."""
        stream = self._lanes.pop(index)
        del self._tasks[index]
        resumable = isinstance(exc, (UpstreamError, UpstreamTimeout))  # the shard's failure, as for n = 1
        if not resumable:
            raise exc
        if index in self.progress.finished:  # its choice was whole: the client reads the code it always did
            raise client_error(exc) if isinstance(exc, SwitchboardError) else exc
        if self.resumes_left <= 0:
            raise unresumed(exc) if isinstance(exc, SwitchboardError) else exc
        self.resumes_left -= 1
        self._tried.add(stream.member.id)
        self._upstream.router.record_resume(stream.member, stream.failure or FailureReason.STREAM_ERROR)
        try:
            await self._open(index)
        except SwitchboardError as again:
            log.warning("choice %d could not be continued elsewhere: %s", index, again.message)
            raise (unresumed(exc) if isinstance(exc, SwitchboardError) else exc) from None

    def close(self) -> None:
        """Idempotent: every lane's stream closed (each shard aborts its choice)."""
        for task in self._tasks.values():
            task.cancel()
        for stream in self._lanes.values():
            with contextlib.suppress(Exception):
                stream.close()
        self._tasks.clear()
        self._lanes.clear()


def _int64(seed: int) -> int:
    """`seed` wrapped into the shard's int64 range: the seed + i of a choice of a request seeded near 2**63 - 1
    was refused (400) by the shard its lane continued on. Draws mix a seed modulo 2**64
    (torch_sampling._mix), so the wrapped seed draws what the first shard's seed + i drew."""
    return (seed + 2**63) % 2**64 - 2**63
