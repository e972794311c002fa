"""Calling shards under supervision: timeouts, one retry elsewhere, streamed events.

    upstream = Upstream(router, HopPool(), UpstreamConfig())
    stream = await upstream.open(request, session_id="s-1")   # a ShardRequest; first token already in hand
    async for events in stream.batches():                  # [Delta / Finish / UsageEvent, ...]
        ...
    stream.close()                                         # closing early aborts the shard's work

`open` returns only once the shard produced its first token (or finished), so the gateway
can still answer any failure with a proper status code: a connect error, a 5xx/503, a
first-token timeout or a stream that dies before its first token is retried once on a
different shard. After that point a failure surfaces as :class:`UpstreamError` from the
iterator and the gateway ends the SSE stream with an error event. A shard's 4xx is the
request's fault: it is passed through, not retried. `open_resumable` instead continues a stream that
breaks mid-way on another shard (data_plane/routing/resume.py).

Events (data_plane/routing/events.py) come in batches: everything the shard has sent by the time the
consumer asks, so a burst of tokens is one wake-up here and one write to the client
(data_plane/routing/hop_client.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from opentelemetry import trace
from opentelemetry.propagate import inject

from data_plane.common.errors import (
    NoHealthyBackend,
    Overloaded,
    SwitchboardError,
    UpstreamError,
    UpstreamTimeout,
    from_openai_body,
)
from data_plane.common.keepalive import KEEPALIVE_HEADER, KEEPALIVE_META, silence_for
from data_plane.common.kv_report import CHAIN_HEADER, parse_chain
from data_plane.membership.view import Member
from data_plane.protocol import INPUT_TOKENS_PATH, ShardRequest, StreamOptions
from data_plane.routing import events as wire
from data_plane.routing.events import Delta, Event, Fingerprint, Finish, ToolCallDelta, UsageEvent
from data_plane.routing.failures import FailureReason
from data_plane.routing.hop_client import (
    HopConnectError,
    HopError,
    HopLocalError,
    HopTimeout,
)
from data_plane.routing.resume import ResumableStream
from data_plane.routing.retry import Retryable, with_retries
from data_plane.routing.router import Router
from data_plane.routing.shard_stream import ShardStream, loss_grace
from data_plane.routing.transport import ShardResponse, ShardTransport

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)
T = TypeVar("T")


CHAT_PATH = "/v1/chat/completions"
REQUEST_NOT_SHARD_CODES = frozenset({"duplicate_request_id", "grammar_compiler_busy"})
"""Shard errors caused by the request itself (or by its grammars' flood): never counted against the shard."""


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
    longest it may send nothing at all (or three of its intervals, when longer: keepalive.silence_for), before
    or after its first token, before the attempt fails over. Used instead of the idle timeout for those shards."""
    retries: int = 1
    """Extra attempts on other shards for failures before the first token."""
    resumes: int = 2
    """Mid-stream failovers per request: the stream continues on another shard."""
    resume_wait_s: float = 0.0
    """How long a stream that broke mid-way (or a request whose shard was lost before its first token, SHARD_GONE)
    waits for a shard to continue on when none is left (the only
    shard, or every other one out): its own shard counts again once it left membership and came back, as a
    restarted process (`switchboard up` restarts a dead shard or pipeline group in seconds). 0: no wait, the
    stream ends with the shard's failure at once."""


SHARD_GONE = frozenset({FailureReason.CONNECT, FailureReason.TIMEOUT, FailureReason.SILENT, FailureReason.TRANSPORT,
                        FailureReason.EMPTY_STREAM, FailureReason.PIPELINE_STAGE_LOST})
"""Failures before the first token that a shard killed, frozen or losing a stage gives: with no other shard, the
request waits for one as a resume does (`resume_wait_s`), not a 5xx, a 429 or an error event, which a live
shard sends."""
RESUME_POLL_S = 0.25
"""While a resume waits for a shard (`resume_wait_s`): how often it looks again."""
RESUME_LEAVE_S = 3.0
"""A resume waits past this only once a failed shard left membership (it died and may be restarted): one
that stays registered (an engine error, a stream cut on a live link) is not coming back as a new process."""


class Upstream:
    def __init__(self, router: Router, pool: ShardTransport, config: UpstreamConfig,
                 headers: Mapping[str, str] | None = None) -> None:
        self.router = router
        self.pool = pool
        self.config = config
        self.headers = dict(headers or {})
        """Sent on every call to a shard: the cluster token (`cluster_headers`), which shards require."""
        self._live: set[ShardStream] = set()
        self._reopens = itertools.count(1)
        """Open streams, so a membership change can fail those whose shard left."""

    def drop_lost(self, statuses: Mapping[str, str]) -> None:
        """Subscribed to a membership view that knows every member's status (shard id -> status):
        a stream whose shard is now critical or gone fails over unless the shard goes on sending
        (ShardStream.lose; a drained shard keeps its streams: it is finishing them)."""
        for stream in list(self._live):
            if statuses.get(stream.member.id, "critical") == "critical":
                stream.lose(loss_grace(stream.member.meta.get(KEEPALIVE_META)))

    async def open(self, request: ShardRequest, session_id: str | None,
                   exclude: set[str] | None = None, failures: list[Retryable] | None = None) -> ShardStream:
        """A stream from the first shard to produce a token: up to 1 + ``retries`` shards, each tried
        once; a failure before the first token is held against its shard (and added to `failures`)."""
        payload = json.dumps(request.wire(), ensure_ascii=False).encode()
        return await self._on_shards(session_id, exclude, lambda member, n: self._try(member, payload, n, session_id),
                                     failures)

    async def reopen(self, request: ShardRequest, session_id: str | None, tried: set[str]) -> ShardStream:
        """`open` for a resume, on a shard not in `tried`. With none left, wait up to ``resume_wait_s`` for
        one: a shard of `tried` that left membership meanwhile is dropped from it (a kill -9 or a lost pipeline
        stage takes it out within a second; its return is a new process, its restart by `up`). With none of
        them gone from membership after RESUME_LEAVE_S, nothing is restarting: the wait ends there."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        left = False
        if request.request_id is not None:  # the shard may still hold the failed attempt under the request's id (a
            # frozen shard that runs again reads the new request before the old one's close: duplicate_request_id)
            request = request.model_copy(update={"request_id": f"{request.request_id[:100]}-retry{next(self._reopens)}"})
        while True:
            try:
                return await self.open(request, session_id, exclude=tried)
            except NoHealthyBackend:
                waited = loop.time() + RESUME_POLL_S - start
                if waited > self.config.resume_wait_s or (waited > RESUME_LEAVE_S and not left):
                    raise
                if waited <= RESUME_POLL_S:
                    log.info("no other shard to resume a stream on: waiting up to %.0f s for one (a restart)",
                             self.config.resume_wait_s)
            await asyncio.sleep(RESUME_POLL_S)
            listed = self.router.shard_ids()
            left = left or not tried <= listed
            tried.intersection_update(listed)

    async def _on_shards(self, session_id: str | None, exclude: set[str] | None,
                         one: Callable[[Member, int], Awaitable[T]], failed: list[Retryable] | None = None) -> T:
        """`one(member, attempt)` on up to 1 + ``retries`` shards the router picks, each tried once: a
        :class:`Retryable` failure is held against its shard (and added to `failed`) and the next is tried;
        when no other shard is left, the last real failure is raised (not "no healthy backend")."""
        tried = set(exclude or ())
        failed = [] if failed is None else failed

        async def attempt(n: int) -> T:
            try:
                member = self.router.pick(session_id, tried)
            except NoHealthyBackend:
                if failed:
                    raise failed[-1].error from None  # every other shard is out: the real failure
                raise
            try:
                return await one(member, n)
            except Retryable as failure:
                self.router.report_failure(member, failure.reason)
                tried.add(member.id)
                failure.member = member
                failed.append(failure)
                raise

        def on_retry(failure: Retryable) -> None:
            assert failure.member is not None
            self.router.record_retry(failure.member, failure.reason)

        return await with_retries(attempt, 1 + self.config.retries, on_retry)

    async def open_resumable(self, request: ShardRequest, session_id: str | None) -> ResumableStream:
        """Like `open`, but the stream resumes on another shard if it breaks mid-way (a copy of `request`
        that asks for usage on every chunk is sent)."""
        usage = StreamOptions(include_usage=True, continuous_usage_stats=True)
        request = request.model_copy(update={"stream_options": usage})
        # router.route is the shard call as a whole, as an HTTP client span is: it ends with the stream
        # (ResumableStream), so the shard.generate spans under it end inside it; `first_token` marks the
        # moment the stream opened with its first token in hand
        span: trace.Span | None = None
        try:
            with tracer.start_as_current_span("router.route", end_on_exit=False) as span:
                first = await self._open_first(request, session_id)
                span.set_attributes({"switchboard.shard": first.member.id, "switchboard.attempts": first.attempts})
                span.add_event("first_token")
        except BaseException:
            if span is not None:
                span.end()  # the error recorded by the context manager's exit
            raise
        return ResumableStream(self, request, session_id, first, self.config.resumes, span)

    async def _open_first(self, request: ShardRequest, session_id: str | None) -> ShardStream:
        """`open`; when every shard tried was gone (a lone shard restarting), waits for one as a resume would."""
        failures: list[Retryable] = []
        try:
            return await self.open(request, session_id, failures=failures)
        except SwitchboardError:
            gone = {f.member.id for f in failures if f.member is not None and f.reason in SHARD_GONE}
            if not (self.config.resume_wait_s and gone) or any(f.reason not in SHARD_GONE for f in failures):
                raise  # a live shard's own failure (a 503, a 429) beside a gone one: answered, not waited on
            try:  # nothing was sent yet
                return await self.reopen(request, session_id, gone)
            except NoHealthyBackend:
                raise failures[-1].error from None

    async def count(self, request: ShardRequest, session_id: str | None) -> int:
        """The prompt tokens `request` would have (a shard's INPUT_TOKENS_PATH: nothing generated), on
        the shard its session's turn would go to (its token-exact transcripts count as that turn would),
        tried like `open`: once more elsewhere when a shard fails, a 4xx passed through."""
        payload = json.dumps(request.wire(), ensure_ascii=False).encode()
        return await self._on_shards(session_id, None, lambda member, n: self._count_on(member, payload))

    async def _count_on(self, member: Member, payload: bytes) -> int:
        """One count on `member`; :class:`Retryable` when the shard failed (unreachable, too slow, or an
        answer without a count), the request's own error (4xx) as it is."""
        timeout = self.config.headers_timeout_s
        leases = ExitStack()
        leases.enter_context(self.router.lease(member))
        response: ShardResponse | None = None
        try:
            response = await self.pool.post(member.url, INPUT_TOKENS_PATH, payload, dict(self.headers),
                                            timeout=timeout)
            if response.status != 200:
                await self._refuse(member, response, leases)
            raw = await response.read(asyncio.get_running_loop().time() + timeout)
            tokens = int(json.loads(raw)["input_tokens"])
        except HopLocalError as exc:
            raise Overloaded(f"the gateway cannot open a connection now ({exc}); retry shortly", retry_after=1) from None
        except HopConnectError:
            raise Retryable(FailureReason.CONNECT, NoHealthyBackend("could not connect to a shard",
                                                                    retry_after=2)) from None
        except HopTimeout:
            raise Retryable(FailureReason.TIMEOUT, UpstreamTimeout("a shard did not answer in time",
                                                                   retry_after=2)) from None
        except (HopError, ValueError, KeyError, TypeError) as exc:  # no count in its answer
            raise Retryable(FailureReason.TRANSPORT, UpstreamError(f"a shard failed to count: {exc}")) from None
        finally:
            _close(response)
            leases.close()
        self.router.report_success(member)
        return tokens

    async def _try(self, member: Member, payload: bytes, attempt: int, session_id: str | None = None) -> ShardStream:
        """One attempt on `member`: connect, headers, first token. Raises :class:`Retryable` for a
        failure another shard may not have, the request's own error (4xx) as it is."""
        cfg = self.config
        leases = ExitStack()
        leases.enter_context(self.router.lease(member))
        span = trace.get_current_span()
        span.set_attribute("switchboard.shard", member.id)
        sent_at = asyncio.get_running_loop().time()
        first_token_by = sent_at + cfg.first_token_timeout_s
        silence = silence_for(member.meta.get(KEEPALIVE_META), cfg.silence_timeout_s)
        response: ShardResponse | None = None
        try:
            response = await self._connect(member, payload, silence)
            if silence is None:  # a shard known by URL only: its stream's header says
                silence = silence_for(response.header(KEEPALIVE_HEADER.encode()), cfg.silence_timeout_s)
            chain = await self._headers(member, response, leases)
            first = await self._first_token(response, first_token_by, silence)
        except HopError as exc:  # HopConnectError / HopTimeout are mapped in their stage
            _close(response)
            leases.close()
            raise Retryable(FailureReason.TRANSPORT, UpstreamError(f"a shard failed: {exc}")) from None
        except BaseException:
            _close(response)
            leases.close()
            raise
        # Successes only: failures (timeouts included) are ejection's to judge (outliers.py); counted here
        # too, a link stalling every other call drew so little traffic it never reached the outlier volume.
        self.router.observe_latency(member, asyncio.get_running_loop().time() - sent_at)
        self.router.report_success(member)
        if chain is not None:  # only once it streams: a shard that failed first holds no KV of it
            self.router.observe_kv(session_id, member.id, chain[1], chain[0])
        span.set_attribute("switchboard.attempts", attempt)
        if (fp := member.meta.get("fingerprint")) and not any(isinstance(e, Fingerprint) for e in first):
            first.insert(0, Fingerprint(fp))  # a shard whose chunks do not say it (vLLM's): its registration does
        stream = ShardStream(member, response, first, leases, self.router, silence or cfg.idle_timeout_s, attempt)
        self._live.add(stream)
        stream.on_close = self._live.discard
        return stream

    async def _connect(self, member: Member, payload: bytes, silence: float | None) -> ShardResponse:
        """Send the request; returns once the shard's headers arrived."""
        cfg = self.config
        reports = self.router.kv_reports
        headers: dict[str, str] = reports.request_headers(member.id) if reports is not None else {}
        headers.update(self.headers)
        inject(headers)
        timeout = min(cfg.headers_timeout_s, cfg.first_token_timeout_s, silence or cfg.headers_timeout_s)
        try:
            return await self.pool.post(member.url, CHAT_PATH, payload, headers, timeout=timeout)
        except HopLocalError as exc:  # this gateway's own shortage (EMFILE): no shard is to blame, none retried
            raise Overloaded(f"the gateway cannot open a connection now ({exc}); retry shortly", retry_after=1) from None
        except HopConnectError:
            raise Retryable(FailureReason.CONNECT,
                            NoHealthyBackend("could not connect to a shard", retry_after=2)) from None
        except HopTimeout:
            raise Retryable(FailureReason.TIMEOUT,
                            UpstreamTimeout("a shard did not answer in time", retry_after=2)) from None

    async def _headers(self, member: Member, response: ShardResponse,
                       leases: ExitStack) -> tuple[str, int] | None:
        """A non-200 status is the shard's refusal; under kv_aware, read what the shard evicted and
        where this prompt's KV will be (its chain)."""
        if response.status != 200:
            await self._refuse(member, response, leases)
        reports = self.router.kv_reports
        if reports is None:
            return None
        reports.read(member.id, response.header)
        return parse_chain(response.header(CHAIN_HEADER.encode()))

    async def _first_token(self, response: ShardResponse, by: float, silence: float | None) -> list[Event]:
        """Every event up to and including the batch with the first token (or finish)."""
        loop = asyncio.get_running_loop()
        first: list[Event] = []
        while True:
            remaining = by - loop.time()
            if remaining <= 0:
                raise self._no_first_token()
            try:
                lines = await response.lines(min(remaining, silence) if silence else remaining)
            except HopTimeout:
                if silence and by - loop.time() > 0:
                    raise Retryable(FailureReason.SILENT, UpstreamTimeout(
                        f"a shard sent nothing, not even a keep-alive, for {silence:g} s", retry_after=2)) from None
                raise self._no_first_token() from None
            if not lines:
                raise Retryable(FailureReason.EMPTY_STREAM,
                                UpstreamError("a shard closed the stream before any token"))
            token = False
            for line in lines:
                parsed = wire.parse_line(line)
                if isinstance(parsed, SwitchboardError):
                    if parsed.status < 500:  # the request's own fault (a grammar no output completes), as a 4xx
                        raise parsed  # status is in `_refuse`: no retry, no ejection (3 such requests ejected it)
                    raise Retryable(FailureReason.for_stream_error(parsed.code, False), wire.client_error(parsed))
                first.extend(parsed)
                token = token or any(isinstance(e, (Delta, ToolCallDelta, Finish)) for e in parsed)
            if token:
                return first

    def _no_first_token(self) -> Retryable:
        return Retryable(FailureReason.FIRST_TOKEN_TIMEOUT, UpstreamTimeout(
            f"no token from a shard within {self.config.first_token_timeout_s:.0f} s", retry_after=2))

    async def _refuse(self, member: Member, response: ShardResponse, leases: ExitStack) -> NoReturn:
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
            raise Retryable(FailureReason.for_status(response.status), error)
        if response.status == 401:  # the shard refused our cluster token: never the client's 401
            log.warning("shard %s refused the gateway's cluster token (SWITCHBOARD_CLUSTER_TOKEN differs)", member.id)
            raise Retryable(FailureReason.REFUSED, UpstreamError("a shard refused this gateway (cluster token "
                                                                 "mismatch)"))
        leases.close()
        self.router.report_success(member)
        raise error


def _close(response: ShardResponse | None) -> None:
    if response is not None:
        response.close()


__all__ = ["CHAT_PATH", "Delta", "Event", "Fingerprint", "Finish", "ResumableStream", "ShardStream", "ToolCallDelta",
           "Upstream", "UpstreamConfig", "UsageEvent"]
