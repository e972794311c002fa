"""A chat completion on its way back to the client: through the output safety filter, as SSE
chunks or one JSON body, with usage, metrics, span attributes and the session turn saved.

    completion = Completion(handler, model, policy.output_stream())
    return StreamingResponse(completion.sse(stream, include_usage), ...)   # or
    body = await completion.collect(stream, request)                       # None: client left

A client that goes away mid-way closes the upstream stream (shielded from the cancellation),
so the shard aborts the generation at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import anyio
from fastapi import Request
from opentelemetry import context as otel_context
from opentelemetry import trace

from data_plane.errors import SwitchboardError
from data_plane.protocol import Usage, chunk_body, completion_body, new_completion_id
from data_plane.safety import ALLOW, OutputStreamFilter
from data_plane.upstream import Delta, Finish, ResumableStream, UsageEvent

if TYPE_CHECKING:
    from data_plane.gateway import ChatHandler

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

DISCONNECT_POLL_S = 0.25
"""How often a non-streaming request checks that its client is still there."""
CLIENT_CLOSED_STATUS = 499
"""Recorded (never sent) when the client left before its answer, as nginx does."""
FINISH_CONTENT_FILTER = "content_filter"


class Completion:
    """Turns a shard's event stream into the client's response, through the output filter."""

    def __init__(self, handler: ChatHandler, model: str, out_filter: OutputStreamFilter) -> None:
        self.h = handler
        self.model = model
        self.filter = out_filter
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)

    async def _events(self, stream: ResumableStream) -> AsyncIterator[str]:
        """Safe text deltas; sets finish_reason and usage. Raises SwitchboardError mid-stream."""
        gw = self.h.gw
        try:
            async for event in stream:
                if isinstance(event, Delta):
                    safe = self.filter.feed(event.text)
                    if safe:
                        self.text.append(safe)
                        yield safe
                    if self.filter.verdict is not None:
                        self.finish_reason = FINISH_CONTENT_FILTER
                        break
                elif isinstance(event, Finish):
                    self.finish_reason = event.reason
                elif isinstance(event, UsageEvent):
                    self.usage = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                       total_tokens=event.prompt_tokens + event.completion_tokens)
        finally:
            # Shielded: after a client disconnect the surrounding cancel scope would cancel this
            # await too, leaving the shard streaming to nobody instead of aborting.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        with tracer.start_as_current_span("safety.output") as span:
            if self.filter.verdict is None:
                tail = self.filter.finish()
                if tail:
                    self.text.append(tail)
                    yield tail
            verdict = self.filter.verdict
            if verdict is not None:
                self.finish_reason = FINISH_CONTENT_FILTER
            gw.safety_metrics.record("output", verdict if verdict is not None else ALLOW)
            span.set_attribute("switchboard.safety.blocked", verdict is not None)

    async def _finish(self, error: str | None) -> None:
        h, gw = self.h, self.h.gw
        tier = h.tier_name
        span = h.span
        assert span is not None
        if error is None:
            await h.save_turn("".join(self.text))
        gw.metrics.e2e.labels(tier).observe(time.monotonic() - h.t0)
        gw.metrics.tokens.labels(tier, "prompt").inc(self.usage.prompt_tokens)
        gw.metrics.tokens.labels(tier, "completion").inc(self.usage.completion_tokens)
        if self.usage.total_tokens:  # the shard reported usage: settle the rate limit with it
            h.used_tokens = self.usage.total_tokens
        span.set_attribute("gen_ai.usage.input_tokens", self.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", self.usage.completion_tokens)
        if self.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])

    async def collect(self, stream: ResumableStream, request: Request) -> dict[str, Any] | None:
        """The whole completion, or None if the client went away first (the shard is aborted)."""
        h = self.h

        async def drain() -> None:
            async for _ in self._events(stream):
                pass

        task = asyncio.create_task(drain(), name=f"collect-{h.request_id}")
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                log.info("request %s: client disconnected; generation aborted", h.request_id)
                await _quiet(self._finish("client_disconnected"))
                h._record(CLIENT_CLOSED_STATUS, "client_disconnected")
                return None
        task.result()
        await self._finish(None)
        h._record(200, "ok")
        return completion_body(completion_id=self.completion_id, model=self.model, text="".join(self.text),
                               finish_reason=self.finish_reason, usage=self.usage, created=self.created)

    async def sse(self, stream: ResumableStream, include_usage: bool) -> AsyncIterator[bytes]:
        h = self.h
        span = h.span
        assert span is not None
        token = otel_context.attach(trace.set_span_in_context(span))
        common = {"completion_id": self.completion_id, "model": self.model, "created": self.created}
        error: str | None = None
        try:
            yield _event(chunk_body(**common, delta={"role": "assistant", "content": ""}))
            async for text in self._events(stream):
                yield _event(chunk_body(**common, delta={"content": text}))
            yield _event(chunk_body(**common, delta={}, finish_reason=self.finish_reason or "stop"))
            await self._finish(None)
            if include_usage:
                yield _event(chunk_body(**common, usage=self.usage, empty_choices=True))
        except SwitchboardError as exc:
            error = exc.code or "error"
            log.warning("request %s failed mid-stream: %s", h.request_id, exc.message)
            yield _event(exc.body(h.request_id, format(span.get_span_context().trace_id, "032x")))
        except asyncio.CancelledError:
            error = "client_disconnected"
            raise
        finally:
            if error is not None:
                with anyio.CancelScope(shield=True):
                    await _quiet(self._finish(error))
                span.set_attribute("error.type", error)
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            h._record(200, "ok" if error is None else error)
            h.gw.metrics.inflight.labels(h.tier_name).dec()
            h._release_limits()
            otel_context.detach(token)
            span.end()
        yield b"data: [DONE]\n\n"


async def _quiet(coro: Any) -> None:
    try:
        await coro
    except Exception:  # bookkeeping after a failure must not raise over it
        log.debug("post-failure bookkeeping failed", exc_info=True)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
