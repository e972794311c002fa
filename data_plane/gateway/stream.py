"""A chat completion on its way back to the client: through the output safety filter, as SSE
chunks or one JSON body, with usage, metrics, span attributes and the session turn saved.

    completion = Completion(exchange, model, policy.output_stream, safety_metrics, save_turn)
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
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace
from starlette.types import Send

from data_plane.common.errors import ShuttingDown, as_error
from data_plane.common.outcome import OK
from data_plane.gateway.exchange import Exchange
from data_plane.gateway.safety.filters import Verdict
from data_plane.gateway.safety.pipeline import ALLOW, OutputStreamFilter, SafetyMetrics
from data_plane.legacy_functions import legacy_delta, legacy_finish, legacy_message
from data_plane.membership.view import Member
from data_plane.protocol import (
    SERVICE_TIER,
    Openings,
    PromptTokensDetails,
    Usage,
    UsageChunks,
    chunk_body,
    completion_body,
    new_completion_id,
)
from data_plane.routing.upstream import Delta, Event, Fingerprint, Finish, ToolCallDelta, UsageEvent
from data_plane.tool_calls import envelope_text

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

FINISH_CONTENT_FILTER = "content_filter"


@dataclass
class _Call:
    """One tool call of a choice: its arguments pass through their own output filter."""

    id: str
    name: str
    filter: OutputStreamFilter
    arguments: list[str] = field(default_factory=list)


@dataclass
class _Choice:
    filter: OutputStreamFilter
    text: list[str] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    has_logprobs: bool = False
    held_logprobs: deque[tuple[int, list[Any]]] = field(default_factory=deque)
    """Logprobs entries not yet sent, each batch with how much of the text fed to the filter it stands for:
    an entry names its token, so sending it before its text would send what the filter holds, or later
    blocks. A batch goes out once the filter released that much (what it releases is a prefix of what it
    was fed): counted in the shard's own pairing of text and tokens, not in the tokens' bytes, which need
    not add up to the text (a tool envelope's escapes, `\\n`, are two bytes of one character)."""
    waiting_logprobs: list[Any] = field(default_factory=list)
    """Entries of deltas that brought no text yet (a partial UTF-8 character, an escape, text a stop string
    holds at the shard): they stand for the next text that comes."""
    fed_chars: int = 0
    released_chars: int = 0

    def hold_logprobs(self, text: str, entries: tuple[Any, ...]) -> None:
        """A delta's `text` (about to be fed to the filter) and its logprobs `entries`."""
        self.waiting_logprobs.extend(entries)
        if text:
            self.fed_chars += len(text)
            if self.waiting_logprobs:
                self.held_logprobs.append((self.fed_chars, self.waiting_logprobs))
                self.waiting_logprobs = []

    def release_logprobs(self, safe: str, everything: bool = False) -> list[Any]:
        """The held entries that `safe`, just released, completes (every one when `everything`: the text
        ended unblocked)."""
        self.released_chars += len(safe)
        held = self.held_logprobs
        if not held and not (everything and self.waiting_logprobs):
            return []
        out: list[Any] = []
        while held and (everything or held[0][0] <= self.released_chars):
            out.extend(held.popleft()[1])
        if everything:
            out.extend(self.waiting_logprobs)
            self.waiting_logprobs = []
        self.logprobs.extend(out)
        return out

    def message(self) -> dict[str, Any]:
        if not self.calls:
            return {"role": "assistant", "content": "".join(self.text)}
        return {"role": "assistant", "content": "".join(self.text) or None,
                "tool_calls": [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": "".join(c.arguments)}} for c in self.calls]}

    def filters(self) -> list[OutputStreamFilter]:
        return [self.filter, *(c.filter for c in self.calls)]


Piece = tuple[int, dict[str, Any]]
"""(choice index, chunk delta) released to the client; a delta may carry ``logprobs`` (moved beside it)."""


class EventSource(Protocol):
    """What a Completion reads: a shard's resumable stream (data_plane/routing/resume.py), or a
    cached reply replayed (data_plane/gateway/response_cache.py)."""

    member: Member

    def batches(self) -> AsyncIterator[list[Event]]: ...

    def close(self) -> None: ...


class Completion:
    """Turns a shard's event stream into the client's response, through the output filter: content and
    every tool call's arguments each pass their own filter, so a blocked phrase inside arguments is
    blocked like one in text (held back while it could still become a match: never half-sent)."""

    def __init__(self, exchange: Exchange, model: str, new_filter: Callable[[], OutputStreamFilter],
                 safety_metrics: SafetyMetrics, save_turn: Callable[[str], Awaitable[None]],
                 logprobs: bool = False, legacy: bool = False) -> None:
        self.x = exchange
        self.legacy = legacy
        """The request gave the deprecated `functions`: its calls go out as `function_call` (data_plane/legacy_functions.py)."""
        self.with_logprobs = logprobs
        """The request asked for logprobs: every choice's body has a `logprobs` object, its `content` empty
        for a reply of no text (a stop string at its first token, EOS, tool calls), as a shard answers it
        and OpenAI's SDK types it (it was null: `choice.logprobs.content` raised on such a reply)."""
        self.safety_metrics = safety_metrics
        self.save_turn = save_turn
        self.model = model
        self.new_filter = new_filter
        self.choices: dict[int, _Choice] = {}
        self._openings = Openings()
        """Which choices the stream opened (their role sent), in index order."""
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        self._final_usage = False
        """The stream's final usage arrived (until then `usage` is the running count, `_usage_so_far`)."""
        self._choice_tokens: dict[int, int] = {}
        self.on_failure: Callable[[str, str], Awaitable[None]] | None = None
        """Called (code, message) when a stream that was answered (status 200 sent) ends without its
        reply: it failed, or the client left. The Responses API keeps such a response (failed or
        incomplete) under the id its first event gave the client; the chat path sets none."""
        self.fingerprint: str | None = None
        """The serving shard's `system_fingerprint` (its numerics, data_plane/shard/engines/fingerprint.py),
        as its stream said it (a `Fingerprint` event): the chunks built here carry it, a resumed stream's
        the new shard's from then on, and the body the last one (a stored completion keeps it)."""
        self._content_prefix = b""
        self._fingerprinted(None)
        self._content_suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def _fingerprinted(self, fingerprint: str | None) -> None:
        # A content chunk is the same JSON but for the text: built when the fingerprint is known, text spliced in.
        self.fingerprint = fingerprint
        head = _json({"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                      "model": self.model, "system_fingerprint": fingerprint, "service_tier": SERVICE_TIER})
        self._content_prefix = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":{"content":'

    def choice(self, index: int) -> _Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = _Choice(self.new_filter())
        return c

    # what the rest of the gateway reads (session turn, ledger, metrics): choice 0
    @property
    def text(self) -> list[str]:
        return self.choice(0).text

    @property
    def finish_reason(self) -> str | None:
        return self.choice(0).finish_reason

    @property
    def tool_calls(self) -> int:
        return sum(len(c.calls) for c in self.choices.values())

    def _blocked(self) -> Verdict | None:
        return next((f.verdict for c in self.choices.values() for f in c.filters() if f.verdict is not None), None)

    def _take(self, event: Event, out: list[Piece]) -> None:
        if isinstance(event, Delta):
            c = self.choice(event.index)
            if event.usage is not None and not self._final_usage:
                self._usage_so_far(event.index, event.usage, event.cached_tokens)
            if event.logprobs:
                c.has_logprobs = True
            c.hold_logprobs(event.text, event.logprobs)
            safe = c.filter.feed(event.text) if event.text else ""
            if safe:
                c.text.append(safe)
            out.extend(_piece(event.index, safe, c.release_logprobs(safe)))
        elif isinstance(event, ToolCallDelta):
            c = self.choice(event.index)
            if event.call >= len(c.calls):
                c.calls.append(_Call(event.id or f"call_{len(c.calls)}", event.name or "", self.new_filter()))
                self.x.tool_calls += 1
                call = c.calls[-1]
                out.append((event.index, {"tool_calls": [{"index": event.call, "id": call.id, "type": "function",
                                                          "function": {"name": call.name, "arguments": ""}}]}))
            call = c.calls[event.call]
            safe = call.filter.feed(event.arguments) if event.arguments else ""
            if safe:
                call.arguments.append(safe)
                out.append((event.index, {"tool_calls": [{"index": event.call, "function": {"arguments": safe}}]}))
        elif isinstance(event, Finish):
            c = self.choice(event.index)
            c.finish_reason = event.reason
        elif isinstance(event, Fingerprint):
            if event.value != self.fingerprint:
                self._fingerprinted(event.value)
        elif isinstance(event, UsageEvent):
            self._final_usage = True
            cached = PromptTokensDetails(cached_tokens=event.cached_tokens)
            self.usage = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                               total_tokens=event.prompt_tokens + event.completion_tokens,
                               prompt_tokens_details=cached)
            self.x.usage = self.usage

    def _usage_so_far(self, index: int, so_far: tuple[int, int], cached: int | None) -> None:
        """The shard's running count (continuous usage stats: every chunk carries it) until its final
        usage arrives. A stream that ends without one (the client left, the shard died past its resumes)
        is then recorded, billed and rate-limited for the prompt it prefilled and the tokens it produced,
        not as 0: otherwise disconnecting just before the end would make any reply free. Its prefix-cache
        hit too (`cached`, the first shard's: a resumed stream's prompt also holds the output so far); it
        was recorded 0, a cached prompt billed as computed."""
        self._choice_tokens[index] = so_far[1]
        prompt = max(so_far[0], self.usage.prompt_tokens)
        completion = sum(self._choice_tokens.values())
        known = self.usage.prompt_tokens_details
        if known is None and cached is not None:
            known = PromptTokensDetails(cached_tokens=min(cached, prompt))
        self.usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=known)
        self.x.usage = self.usage

    def _tails(self) -> list[Piece]:
        """What the filters still hold once the upstream ended (nothing was blocked)."""
        out: list[Piece] = []
        for index, c in sorted(self.choices.items()):
            tail = c.filter.finish()
            if tail:
                c.text.append(tail)
            out.extend(_piece(index, tail, c.release_logprobs(tail, everything=True)))
            for k, call in enumerate(c.calls):
                rest = call.filter.finish()
                if rest:
                    call.arguments.append(rest)
                    out.append((index, {"tool_calls": [{"index": k, "function": {"arguments": rest}}]}))
        return out

    async def _batches(self, stream: EventSource) -> AsyncIterator[list[Piece]]:
        """Safe pieces, one list per batch of events that arrived together (the filters see the same text
        either way; the client gets one write per burst instead of one per token). Sets finish reasons and
        usage. Raises SwitchboardError mid-stream."""
        self.choice(0)
        try:
            async for events in stream.batches():
                out: list[Piece] = []
                for event in events:
                    self._take(event, out)
                if out:
                    yield out
                    if self.x.first_content_at is None:
                        self._first_content()
                if self._blocked() is not None:
                    break
        finally:
            stream.close()  # synchronous: nothing for a cancellation to interrupt; the shard aborts
        with tracer.start_as_current_span("safety.output") as span:
            if self._blocked() is None:
                tail = self._tails()
                if tail:
                    yield tail
                    if self.x.first_content_at is None:
                        self._first_content()
            verdict = self._blocked()
            if verdict is not None:
                for c in self.choices.values():
                    c.finish_reason = FINISH_CONTENT_FILTER
            self.safety_metrics.record("output", verdict if verdict is not None else ALLOW)
            span.set_attribute("switchboard.safety.blocked", verdict is not None)
            span.set_attribute("switchboard.safety.max_held_chars",
                               max(f.max_held for c in self.choices.values() for f in c.filters()))
            if self.tool_calls:
                span.set_attribute("switchboard.tools.calls", self.tool_calls)

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

    def reply(self) -> str:
        """Choice 0 as the session transcript keeps it: its text, or the tool envelope it produced."""
        c = self.choice(0)
        if not c.calls:
            return "".join(c.text)
        message = c.message()
        return envelope_text(message["content"], message["tool_calls"])

    async def _finish(self, error: str | None) -> None:
        x = self.x
        tier, span = x.tier_name, x.span
        if error is None:
            await self.save_turn(self.reply())
        x.metrics.e2e.labels(tier).observe(time.monotonic() - x.t0)
        x.metrics.tokens.labels(tier, "prompt").inc(self.usage.prompt_tokens)
        x.metrics.tokens.labels(tier, "completion").inc(self.usage.completion_tokens)
        if self.usage.total_tokens:  # the shard reported usage: settle the rate limit with it
            x.used_tokens = self.usage.total_tokens
        span.set_attribute("gen_ai.usage.input_tokens", self.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", self.usage.completion_tokens)
        reasons = [c.finish_reason for _, c in sorted(self.choices.items()) if c.finish_reason]
        if reasons:
            span.set_attribute("gen_ai.response.finish_reasons", reasons)

    async def collect(self, stream: EventSource) -> dict[str, Any]:
        """The whole completion as one chat.completion body. A client that leaves meanwhile
        cancels the task (the Exchange's DisconnectWatch), which closes the stream: the shard aborts."""
        try:
            async for _ in self._batches(stream):
                pass
            await self._finish(None)
        except asyncio.CancelledError:
            if self.x.client_gone:
                await _quiet(self._finish(self.x.gone_as[1]))
            raise
        finally:
            stream.close()  # idempotent; here for a cancellation before the first batch
        return self.body()

    def body(self) -> dict[str, Any]:
        """The chat.completion object of what was released so far (every choice): the reply's JSON
        body, and what a stored completion keeps whether it was streamed or not."""
        body = completion_body(completion_id=self.completion_id, model=self.model, text="",
                               finish_reason=None, usage=self.usage, created=self.created, fingerprint=self.fingerprint)
        # `refusal` is never set here, but OpenAI's spec requires it (null) in a reply's message and logprobs
        message, finish = (legacy_message, legacy_finish) if self.legacy else (_same, _same)
        body["choices"] = [{"index": i, "message": {**message(c.message()), "refusal": None},
                            "logprobs": {"content": c.logprobs, "refusal": None}
                            if c.has_logprobs or self.with_logprobs else None,
                            "finish_reason": finish(c.finish_reason)} for i, c in sorted(self.choices.items())]
        return body

    def _chunk(self, common: dict[str, Any], piece: Piece, content_suffix: bytes) -> bytes:
        index, delta = piece
        if index == 0 and list(delta) == ["content"]:
            return self._content_prefix + _json(delta["content"]) + content_suffix
        delta = dict(delta)
        logprobs = delta.pop("logprobs", None)
        if logprobs is None and "role" in delta and self.with_logprobs:
            # each choice opens with its logprobs object, as OpenAI's: the SDK's stream helper builds the final
            # completion's from the chunks, and a reply of no text (tool calls, a stop string first) had None
            logprobs = {"content": [], "refusal": None}
        return _event(chunk_body(**common, delta=delta, index=index, logprobs=logprobs))

    async def stream_to(self, send: Send, stream: EventSource, include_usage: UsageChunks | bool,
                        headers: list[tuple[bytes, bytes]]) -> None:
        """The completion as SSE, straight onto the ASGI `send`: one write per batch of tokens,
        each choice opened with its first piece (`opening_deltas`: ``content: null`` beside a first tool
        call, ``content: ""`` before text; in index order: `Openings`), the finish, usage and `[DONE]` with
        the last."""
        x = self.x
        span = x.span
        common: dict[str, Any] = {"completion_id": self.completion_id, "model": self.model, "created": self.created,
                                  "include_usage": bool(include_usage), "fingerprint": self.fingerprint}
        content_suffix = self._content_suffix[:-3] + b',"usage":null}\n\n' if include_usage else self._content_suffix
        every = include_usage == UsageChunks.EVERY  # vLLM's continuous_usage_stats: the usage so far on each chunk
        error: str | None = None
        gone_status: int | None = None  # the receiving end left: 499, or a status the server stopped it with
        message = "the client disconnected"
        out: list[bytes] = []
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for pieces in self._batches(stream):
                common["fingerprint"] = self.fingerprint  # the shard's, once its stream said it (a resume: the new one's)
                if every:
                    common["usage"] = self.usage
                    content_suffix = self._content_suffix[:-3] + b',"usage":' + _json(self.usage.wire()) + b'}\n\n'
                for index, delta in pieces:
                    sent = self._openings.deltas(index, legacy_delta(delta) if self.legacy else delta)
                    out.extend(self._chunk(common, piece, content_suffix) for piece in sent)
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                out = []
            for index, c in sorted(self.choices.items()):  # a choice that released nothing still opens
                out.extend(self._chunk(common, piece, content_suffix) for piece in self._openings.ending(index))
                finish = legacy_finish(c.finish_reason) if self.legacy else c.finish_reason
                out.append(_event(chunk_body(**common, delta={}, finish_reason=finish or "stop", index=index)))
            await self._finish(None)
            if include_usage:
                common.pop("usage", None)
                out.append(_event(chunk_body(**common, usage=self.usage, empty_choices=True)))
        except asyncio.CancelledError:
            if x.client_gone:
                gone_status, error = x.gone_as
                raise
            # Nobody left: the server cancelled us, uvicorn past the shutdown grace (a restart, a deploy,
            # Ctrl-C). The connection is still open: end the stream in words. The cancel is not raised
            # again: the response is whole, and uvicorn would log it as the app's traceback.
            stopping = ShuttingDown("the gateway is shutting down and could not finish this stream within its "
                                    "shutdown grace; retry the request")
            error, message = stopping.code or "error", stopping.message
            out.append(_event(stopping.body(x.request_id, x.trace_id)))
        except Exception as exc:  # noqa: BLE001 -- a bug must still end the stream properly, not cut it off
            failure = as_error(exc, f"request {x.request_id} mid-stream")
            if failure is exc:
                log.warning("request %s failed mid-stream: %s", x.request_id, failure.message)
            error, message = failure.code or "error", failure.message
            out.append(_event(failure.body(x.request_id, x.trace_id)))
        finally:
            stream.close()  # idempotent; here for a cancellation before the first batch
            if error is not None:
                await _quiet(self._finish(error))
                if self.on_failure is not None:  # before the error event is written: retrievable once read
                    await _quiet(self.on_failure(error, message))
                span.set_attribute("error.type", error)
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            x.close(gone_status or 200, OK if error is None else error)
        out.append(b"data: [DONE]\n\n")
        x.disconnect.stop()
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})


async def _quiet(coro: Any) -> None:
    try:
        await coro
    except Exception:  # bookkeeping after a failure must not raise over it
        log.debug("post-failure bookkeeping failed", exc_info=True)


def _piece(index: int, text: str, logprobs: list[Any]) -> list[Piece]:
    """A choice's released text and the logprobs entries it completes, as a delta (none when both are empty)."""
    if not text and not logprobs:
        return []
    delta: dict[str, Any] = {"content": text} if text else {}
    if logprobs:
        delta["logprobs"] = {"content": logprobs, "refusal": None}
    return [(index, delta)]


def _same(value: Any) -> Any:
    return value


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + _json(body) + b"\n\n"
