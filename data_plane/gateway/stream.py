"""A chat completion on its way back to the client: through the output safety filter, as SSE
chunks or one JSON body, with usage, metrics, span attributes and the session turn saved.

    completion = Completion(exchange, model, policy.output_stream(), safety_metrics, save_turn)
    await completion.stream_to(send, stream, include_usage, headers)   # SSE onto the ASGI send, or
    body = await completion.collect(stream)                            # one chat.completion body

A client that goes away mid-way cancels the request's task (the Exchange's DisconnectWatch);
the upstream stream is closed synchronously on the way out, so the shard aborts the generation at
its next step. Streaming, the Exchange (data_plane/gateway/exchange.py) is closed here, before the
last write; with one JSON body, by ChatHandler once the body is ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from opentelemetry import trace
from starlette.types import Send

from data_plane.common.disconnect import CLIENT_CLOSED_STATUS
from data_plane.common.errors import as_error
from data_plane.protocol import PromptTokensDetails, Usage, chunk_body, completion_body, new_completion_id
from data_plane.gateway.exchange import Exchange
from data_plane.gateway.safety.pipeline import ALLOW, OutputStreamFilter, SafetyMetrics
from data_plane.membership.view import Member
from data_plane.routing.upstream import Delta, Event, Finish, UsageEvent

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

FINISH_CONTENT_FILTER = "content_filter"


class EventSource(Protocol):
    """What a Completion reads: a shard's resumable stream (data_plane/routing/upstream.py), or a
    cached reply replayed (data_plane/gateway/response_cache.py)."""

    member: Member

    def batches(self) -> AsyncIterator[list[Event]]: ...

    def close(self) -> None: ...


class Completion:
    """Turns a shard's event stream into the client's response, through the output filter."""

    def __init__(self, exchange: Exchange, model: str, out_filter: OutputStreamFilter, safety_metrics: SafetyMetrics,
                 save_turn: Callable[[str], Awaitable[None]]) -> None:
        self.x = exchange
        self.safety_metrics = safety_metrics
        self.save_turn = save_turn
        self.model = model
        self.filter = out_filter
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        # A content chunk is the same JSON but for the text: built once, the text spliced in.
        head = _json({"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                      "model": model})
        self._content_prefix = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":{"content":'
        self._content_suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    async def _batches(self, stream: EventSource) -> AsyncIterator[str]:
        """Safe text, one piece per batch of deltas that arrived together (the filter sees the
        same text either way; the client gets one chunk per burst instead of one per token).
        Sets finish_reason and usage. Raises SwitchboardError mid-stream."""
        try:
            async for events in stream.batches():
                texts: list[str] = []
                for event in events:
                    if isinstance(event, Delta):
                        texts.append(event.text)
                    elif isinstance(event, Finish):
                        self.finish_reason = event.reason
                    elif isinstance(event, UsageEvent):
                        cached = PromptTokensDetails(cached_tokens=event.cached_tokens)
                        self.usage = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                           total_tokens=event.prompt_tokens + event.completion_tokens,
                                           prompt_tokens_details=cached)
                if texts:
                    safe = self.filter.feed(texts[0] if len(texts) == 1 else "".join(texts))
                    if safe:
                        self.text.append(safe)
                        yield safe
                        if self.x.first_content_at is None:
                            self._first_content()
                    if self.filter.verdict is not None:
                        self.finish_reason = FINISH_CONTENT_FILTER
                        break
        finally:
            stream.close()  # synchronous: nothing for a cancellation to interrupt; the shard aborts
        with tracer.start_as_current_span("safety.output") as span:
            if self.filter.verdict is None:
                tail = self.filter.finish()
                if tail:
                    self.text.append(tail)
                    yield tail
                    if self.x.first_content_at is None:
                        self._first_content()
            verdict = self.filter.verdict
            if verdict is not None:
                self.finish_reason = FINISH_CONTENT_FILTER
            self.safety_metrics.record("output", verdict if verdict is not None else ALLOW)
            span.set_attribute("switchboard.safety.blocked", verdict is not None)
            span.set_attribute("switchboard.safety.max_held_chars", self.filter.max_held)

    def _first_content(self) -> None:
        """The client's time to first token: called right after the first content was handed to the
        client (streaming: written to the socket; otherwise released into the body)."""
        x = self.x
        now = x.first_content_at = time.monotonic()
        tier = x.tier_name
        x.metrics.ttft.labels(tier).observe(now - x.t0)
        if x.first_token_at is not None:
            x.metrics.holdback.labels(tier).observe(now - x.first_token_at)
            x.span.set_attribute("switchboard.gateway.holdback_s", round(now - x.first_token_at, 6))
        x.span.set_attribute("switchboard.gateway.ttft_s", round(now - x.t0, 6))

    async def _finish(self, error: str | None) -> None:
        x = self.x
        tier, span = x.tier_name, x.span
        if error is None:
            await self.save_turn("".join(self.text))
        x.metrics.e2e.labels(tier).observe(time.monotonic() - x.t0)
        x.metrics.tokens.labels(tier, "prompt").inc(self.usage.prompt_tokens)
        x.metrics.tokens.labels(tier, "completion").inc(self.usage.completion_tokens)
        if self.usage.total_tokens:  # the shard reported usage: settle the rate limit with it
            x.used_tokens = self.usage.total_tokens
        span.set_attribute("gen_ai.usage.input_tokens", self.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", self.usage.completion_tokens)
        if self.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])

    async def collect(self, stream: EventSource) -> dict[str, Any]:
        """The whole completion as one chat.completion body. A client that leaves meanwhile
        cancels the task (the Exchange's DisconnectWatch), which closes the stream: the shard aborts."""
        try:
            async for _ in self._batches(stream):
                pass
            await self._finish(None)
        except asyncio.CancelledError:
            if self.x.client_gone:
                await _quiet(self._finish("client_disconnected"))
            raise
        finally:
            stream.close()  # idempotent; here for a cancellation before the first batch
        return completion_body(completion_id=self.completion_id, model=self.model, text="".join(self.text),
                               finish_reason=self.finish_reason, usage=self.usage, created=self.created)

    async def stream_to(self, send: Send, stream: EventSource, include_usage: bool,
                        headers: list[tuple[bytes, bytes]]) -> None:
        """The completion as SSE, straight onto the ASGI `send`: one write per batch of tokens,
        the role chunk riding with the first, the finish, usage and `[DONE]` with the last."""
        x = self.x
        span = x.span
        common: dict[str, Any] = {"completion_id": self.completion_id, "model": self.model, "created": self.created}
        error: str | None = None
        out = [_event(chunk_body(**common, delta={"role": "assistant", "content": ""}))]
        prefix, suffix = self._content_prefix, self._content_suffix
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for text in self._batches(stream):
                out.append(prefix + _json(text) + suffix)
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                out = []
            out.append(_event(chunk_body(**common, delta={}, finish_reason=self.finish_reason or "stop")))
            await self._finish(None)
            if include_usage:
                out.append(_event(chunk_body(**common, usage=self.usage, empty_choices=True)))
        except asyncio.CancelledError:
            error = "client_disconnected"
            raise
        except Exception as exc:
            # a bug must still end the stream properly, not cut it off
            failure = as_error(exc, f"request {x.request_id} mid-stream")
            if failure is exc:
                log.warning("request %s failed mid-stream: %s", x.request_id, failure.message)
            error = failure.code or "error"
            out.append(_event(failure.body(x.request_id, x.trace_id)))
        finally:
            stream.close()  # idempotent; here for a cancellation before the first batch
            if error is not None:
                await _quiet(self._finish(error))
                span.set_attribute("error.type", error)
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            x.close(CLIENT_CLOSED_STATUS if error == "client_disconnected" else 200, "ok" if error is None else error)
        out.append(b"data: [DONE]\n\n")
        x.disconnect.stop()
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})


async def _quiet(coro: Any) -> None:
    try:
        await coro
    except Exception:  # bookkeeping after a failure must not raise over it
        log.debug("post-failure bookkeeping failed", exc_info=True)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + _json(body) + b"\n\n"
