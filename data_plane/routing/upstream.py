"""Calling shards under supervision: timeouts, one retry elsewhere, streamed events.

    upstream = Upstream(router, HopPool(), UpstreamConfig())
    stream = await upstream.open(body, session_id="s-1")   # first token already in hand
    async for events in stream.batches():                  # [Delta / Finish / UsageEvent, ...]
        ...
    stream.close()                                         # closing early aborts the shard's work

`open` returns only once the shard produced its first token (or finished), so the gateway
can still answer any failure with a proper status code: a connect error, a 5xx/503, a
first-token timeout or a stream that dies before its first token is retried once on a
different shard. After that point a failure surfaces as :class:`UpstreamError` from the
iterator and the gateway ends the SSE stream with an error event. A shard's 4xx is the
request's fault: it is passed through, not retried.

Events come in batches: everything the shard has sent by the time the consumer asks, so a
burst of tokens is one wake-up here and one write to the client (data_plane/routing/hop_client.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, NoReturn

from opentelemetry import trace
from opentelemetry.propagate import inject

from data_plane.common.errors import (
    NoHealthyBackend,
    SwitchboardError,
    UpstreamError,
    UpstreamTimeout,
    from_openai_body,
)
from data_plane.routing.hop_client import (
    HopConnectError,
    HopDisconnected,
    HopError,
    HopPool,
    HopResponse,
    HopTimeout,
)
from data_plane.common.keepalive import KEEPALIVE_META
from data_plane.membership.view import Member
from data_plane.common.kv_report import CHAIN_HEADER, parse_chain
from data_plane.routing.router import Router

log = logging.getLogger(__name__)


CHAT_PATH = "/v1/chat/completions"
REQUEST_NOT_SHARD_CODES = frozenset({"duplicate_request_id"})
"""Shard errors caused by the request itself: never counted against the shard."""


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 2.0
    """TCP connect to a shard."""
    headers_timeout_s: float = 5.0
    """Sending the request to response headers. Shards answer headers before queueing, so a
    silent one (e.g. a partitioned host on a pooled connection) is given up on quickly."""
    first_token_timeout_s: float = 60.0
    """From sending the request to the first token (includes the shard's queue)."""
    idle_timeout_s: float = 30.0
    """Longest gap between two events once streaming."""
    silence_timeout_s: float = 2.0
    """For a shard that announces SSE keep-alives (meta ``keepalive_s``, data_plane/common/keepalive.py): the
    longest it may send nothing at all, before or after its first token, before the attempt fails
    over (a dead host, process or link). Used instead of the idle timeout for those shards."""
    retries: int = 1
    """Extra attempts on other shards for failures before the first token."""
    resumes: int = 2
    """Mid-stream failovers per request: the stream continues on another shard."""


@dataclass(frozen=True)
class Delta:
    text: str
    usage: tuple[int, int] | None = None
    """(prompt_tokens, completion_tokens so far), when the shard reports continuous usage."""
    index: int = 0
    """The choice (``n``)."""
    logprobs: tuple[Any, ...] = ()
    """OpenAI logprobs ``content`` entries of this chunk, as the shard sent them."""


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed tool-call fragment (OpenAI's shape): `id` and `name` on a call's first, `arguments`
    fragments after."""

    call: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    index: int = 0


@dataclass(frozen=True)
class Finish:
    reason: str
    index: int = 0


@dataclass(frozen=True)
class UsageEvent:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens the shard served from its prefix cache (usage.prompt_tokens_details)."""


Event = Delta | ToolCallDelta | Finish | UsageEvent


class _Retryable(Exception):
    def __init__(self, reason: str, error: SwitchboardError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def _parse(line: bytes) -> Event | SwitchboardError | None:
    """One SSE line from a shard -> an event, an error, or None (role chunk, comment, [DONE])."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    try:
        body = json.loads(data)
    except ValueError:
        return UpstreamError("a shard sent a malformed stream event")
    if not isinstance(body, dict):
        return UpstreamError("a shard sent a malformed stream event")
    if "error" in body:
        return from_openai_body(502, body)
    choices = body.get("choices") or []
    usage = body.get("usage")
    if choices:
        choice = choices[0]
        index = int(choice.get("index") or 0)
        if choice.get("finish_reason"):
            return Finish(choice["finish_reason"], index)
        delta = choice.get("delta") or {}
        calls = delta.get("tool_calls")
        if calls:
            call = calls[0]
            fn = call.get("function") or {}
            return ToolCallDelta(int(call.get("index") or 0), call.get("id"), fn.get("name"),
                                 fn.get("arguments") or "", index)
        content = delta.get("content")
        logprobs = tuple((choice.get("logprobs") or {}).get("content") or ())
        if content or logprobs:
            so_far = None
            if usage:
                so_far = (int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
            return Delta(content or "", so_far, index, logprobs)
        return None
    if usage:
        details = usage.get("prompt_tokens_details")
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        return UsageEvent(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), cached)
    return None


class ShardStream:
    """An open, supervised stream from one shard; iterate `batches()` for the events after the
    first batch: every event that has arrived, at once."""

    def __init__(self, member: Member, response: HopResponse, first: list[Event], leases: ExitStack,
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
        self.on_close: Callable[[ShardStream], None] | None = None

    def lose(self) -> None:
        """The shard left membership (critical or gone) mid-stream: fail the stream now, so it
        resumes elsewhere instead of waiting for silence."""
        if not self._closed and not self._lost:
            self._lost = True
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
                    self._router.report_failure(self.member, "stream_idle")
                    raise UpstreamTimeout(f"the shard stopped streaming for {self._idle:g} s") from None
                except HopError as exc:
                    if self._lost:
                        self._router.report_failure(self.member, "membership_lost")
                        raise UpstreamError("the shard left membership mid-stream") from None
                    self._router.report_failure(self.member, "stream_broken")
                    raise UpstreamError(f"the shard's stream broke: {exc}") from None
                if not lines:
                    return
                events: list[Event] = []
                for line in lines:
                    event = _parse(line)
                    if isinstance(event, SwitchboardError):
                        if events:
                            yield events
                        raise event
                    if event is not None:
                        events.append(event)
                if events:
                    yield events
        finally:
            self.close()

    def close(self) -> None:
        """Idempotent. A stream not read to its end drops the connection: the shard aborts."""
        if self._closed:
            return
        self._closed = True
        try:
            self._response.close()
        finally:
            self._leases.close()
            if self.on_close is not None:
                self.on_close(self)


class Upstream:
    def __init__(self, router: Router, pool: HopPool, config: UpstreamConfig) -> None:
        self.router = router
        self.pool = pool
        self.config = config
        self._live: set[ShardStream] = set()
        """Open streams, so a membership change can fail those whose shard left."""

    def drop_lost(self, statuses: Mapping[str, str]) -> None:
        """Subscribed to a membership view that knows every member's status (shard id -> status):
        a stream whose shard is now critical or gone fails over at once (a drained shard keeps its
        streams: it is finishing them)."""
        for stream in list(self._live):
            if statuses.get(stream.member.id, "critical") == "critical":
                log.warning("shard %s left membership mid-stream; resuming elsewhere", stream.member.id)
                stream.lose()

    async def open(self, body: dict[str, Any], session_id: str | None,
                   exclude: set[str] | None = None) -> ShardStream:
        exclude = set(exclude or ())
        last_error: SwitchboardError | None = None
        payload = json.dumps(body, ensure_ascii=False).encode()
        for attempt in range(1 + self.config.retries):
            try:
                member = self.router.pick(session_id, exclude)
            except NoHealthyBackend:
                if last_error is not None:
                    raise last_error from None
                raise
            try:
                stream = await self._try(member, payload, attempt + 1, session_id)
            except _Retryable as failure:
                self.router.report_failure(member, failure.reason)
                exclude.add(member.id)
                last_error = failure.error
                if attempt < self.config.retries:
                    self.router.record_retry(member, failure.reason)
                continue
            return stream
        assert last_error is not None
        raise last_error

    async def open_resumable(self, body: dict[str, Any], session_id: str | None) -> ResumableStream:
        """Like `open`, but the stream resumes on another shard if it breaks mid-way."""
        body = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        return ResumableStream(self, body, session_id, await self.open(body, session_id))

    async def _try(self, member: Member, payload: bytes, attempt: int, session_id: str | None = None) -> ShardStream:
        cfg = self.config
        leases = ExitStack()
        leases.enter_context(self.router.lease(member))
        reports = self.router.kv_reports
        headers: dict[str, str] = reports.request_headers(member.id) if reports is not None else {}
        chain: tuple[str, int] | None = None
        inject(headers)
        span = trace.get_current_span()
        span.set_attribute("switchboard.shard", member.id)
        response: HopResponse | None = None
        loop = asyncio.get_running_loop()
        first_token_by = loop.time() + cfg.first_token_timeout_s
        silence = cfg.silence_timeout_s if KEEPALIVE_META in member.meta else None
        try:
            try:
                response = await self.pool.post(member.url, CHAT_PATH, payload, headers, timeout=min(
                    cfg.headers_timeout_s, cfg.first_token_timeout_s, silence or cfg.headers_timeout_s))
            except HopTimeout:
                raise _Retryable("timeout", UpstreamTimeout("a shard did not answer in time", retry_after=2)) from None
            if response.status != 200:
                await self._refuse(member, response, leases)
            if reports is not None:  # kv_aware: what the shard evicted, and where this prompt's KV will be
                reports.read(member.id, response.header)
                chain = parse_chain(response.header(CHAIN_HEADER.encode()))
            first: list[Event] = []
            token = False
            try:
                while not token:
                    remaining = first_token_by - loop.time()
                    if remaining <= 0:
                        raise HopTimeout("no first token")
                    try:
                        lines = await response.lines(min(remaining, silence) if silence else remaining)
                    except HopTimeout:
                        if silence and first_token_by - loop.time() > 0:
                            raise _Retryable("silent", UpstreamTimeout(
                                f"a shard sent nothing, not even a keep-alive, for {silence:g} s",
                                retry_after=2)) from None
                        raise
                    if not lines:
                        raise _Retryable("empty_stream", UpstreamError("a shard closed the stream before any token"))
                    for line in lines:
                        event = _parse(line)
                        if isinstance(event, SwitchboardError):
                            raise _Retryable("stream_error_before_first_token", event)
                        if event is not None:
                            first.append(event)
                            token = token or isinstance(event, (Delta, ToolCallDelta, Finish))
            except HopTimeout:
                raise _Retryable("first_token_timeout", UpstreamTimeout(
                    f"no token from a shard within {cfg.first_token_timeout_s:.0f} s", retry_after=2)) from None
        except HopConnectError:
            leases.close()
            raise _Retryable("connect", NoHealthyBackend("could not connect to a shard", retry_after=2)) from None
        except HopError as exc:
            _close(response)
            leases.close()
            raise _Retryable("transport", UpstreamError(f"a shard failed: {exc}")) from None
        except BaseException:
            _close(response)
            leases.close()
            raise
        self.router.report_success(member)
        if chain is not None:  # only once it streams: a shard that failed first holds no KV of it
            self.router.observe_kv(session_id, member.id, chain[1], chain[0])
        span.set_attribute("switchboard.attempts", attempt)
        stream = ShardStream(member, response, first, leases, self.router, silence or cfg.idle_timeout_s, attempt)
        self._live.add(stream)
        stream.on_close = self._live.discard
        return stream

    async def _refuse(self, member: Member, response: HopResponse, leases: ExitStack) -> NoReturn:
        """A non-200 answer: the shard's own error, retried elsewhere if it is the shard's fault."""
        try:
            raw = await response.read(asyncio.get_running_loop().time() + self.config.headers_timeout_s)
        except HopError:
            raw = b""
        finally:
            response.close()
        try:
            err_body = json.loads(raw)
        except ValueError:
            err_body = None
        error = from_openai_body(response.status, err_body)
        if error.code in REQUEST_NOT_SHARD_CODES:
            leases.close()
            raise error  # the request's fault, not the shard's: no retry, no ejection
        if response.status >= 500 or response.status == 429:
            raise _Retryable(f"status_{response.status}", error)
        leases.close()
        self.router.report_success(member)
        raise error


def _close(response: HopResponse | None) -> None:
    if response is not None:
        response.close()


CONSTRAINING_FIELDS = ("tools", "response_format", "structured_outputs")


def resumable(body: dict[str, Any]) -> bool:
    """A stream may continue on another shard as a plain continuation of its text: not when its output
    follows a grammar or carries tool calls (the continuation would not continue the grammar, so the
    stream ends with an error event instead), nor with several choices."""
    rf = body.get("response_format")
    constrained = any(body.get(k) for k in CONSTRAINING_FIELDS if k != "response_format") or (
        isinstance(rf, dict) and rf.get("type") not in (None, "text"))
    return not constrained and int(body.get("n") or 1) == 1


class ResumableStream:
    """A stream that survives shard failures after its first token.

        stream = await upstream.open_resumable(body, session_id)
        async for events in stream.batches(): ...

    When the shard's stream breaks mid-way, the request is re-opened on another shard with the
    prompt plus the text already received as a final assistant message to *continue*
    (vLLM's `continue_final_message`), and `max_tokens` reduced by the tokens already
    generated; the client sees one seamless stream. Greedy decoding in float32 gives the same
    text as an uninterrupted run. Usage is reported against the original prompt.
    """

    def __init__(self, upstream: Upstream, body: dict[str, Any], session_id: str | None,
                 first: ShardStream) -> None:
        self._upstream = upstream
        self._body = body
        self._session_id = session_id
        self._stream = first
        self.member = first.member
        self.attempts = first.attempts
        self.resumes = 0
        self._received: list[str] = []
        self._prompt_tokens: int | None = None
        self._base_completion = 0  # tokens generated by earlier, failed streams
        self._completion = 0

    async def batches(self) -> AsyncIterator[list[Event]]:
        tried: set[str] = set()
        while True:
            finished = False
            try:
                async for events in self._stream.batches():
                    out: list[Event] = []
                    for event in events:
                        if isinstance(event, Delta):
                            self._received.append(event.text)
                            if event.usage is not None:
                                if self._prompt_tokens is None:
                                    self._prompt_tokens = event.usage[0]
                                self._completion = self._base_completion + event.usage[1]
                            out.append(event)
                        elif isinstance(event, ToolCallDelta):
                            out.append(event)
                        elif isinstance(event, Finish):
                            finished = True
                            out.append(event)
                        elif isinstance(event, UsageEvent):
                            prompt = self._prompt_tokens if self._prompt_tokens is not None else event.prompt_tokens
                            out.append(UsageEvent(prompt, self._base_completion + event.completion_tokens,
                                                  event.cached_tokens))
                    yield out
                return
            except (UpstreamError, UpstreamTimeout) as exc:
                if finished or self.resumes >= self._upstream.config.resumes or not resumable(self._body):
                    raise
                failed = self._stream.member
                tried.add(failed.id)
                self.resumes += 1
                self._base_completion = self._completion
                remaining = int(self._body.get("max_tokens") or 0) - self._base_completion
                self._upstream.router.record_resume(failed, exc.code or "error")
                if remaining <= 0:
                    yield [Finish("length")]
                    return
                body = dict(self._body)
                body["messages"] = list(self._body["messages"]) + [
                    {"role": "assistant", "content": "".join(self._received)}]
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
                body["max_tokens"] = remaining
                try:
                    self._stream = await self._upstream.open(body, self._session_id, exclude=tried)
                except SwitchboardError:
                    raise exc from None
                self.member = self._stream.member

    def close(self) -> None:
        self._stream.close()
