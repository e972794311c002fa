"""One chat request's hold on the gateway, owned by one object and released exactly once.

    x = Exchange(gw.metrics, gw.limiter, span, request_id, disconnect, on_record=ledger_hook)
    x.grant = await limiter.admit(...)        # the rate-limit grant (settled at close)
    x.admitted(await admission.acquire(...))  # the in-flight slot, and the in-flight gauge up
    ...
    x.close(200, "ok")                        # the request's Outcome built, counted and recorded (the
                                              # ledger), gauge down, slot freed, grant settled, its key's
                                              # hold released, span ended: once, whoever calls

ChatHandler (data_plane/gateway/chat.py) creates it; Completion (data_plane/gateway/stream.py)
records timings and usage on it and closes it before the stream's last write. A second `close` is a
no-op, so every exit path may call it. What the request came to is one frozen `Outcome`
(data_plane/common/outcome.py), built from what the phases set here as they learned it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from opentelemetry import trace

from data_plane.common.disconnect import CLIENT_CLOSED_STATUS, CLIENT_DISCONNECTED, DisconnectWatch
from data_plane.common.outcome import OK, Outcome
from data_plane.gateway.admission import Ticket
from data_plane.gateway.metrics import GatewayMetrics, request_code
from data_plane.gateway.ratelimit.limiter import Grant, RateLimiter
from data_plane.protocol import Usage


class Hold(Protocol):
    """Something the request holds until it ends: its place among its key's requests in flight
    (data_plane/gateway/revocation.py InFlight)."""

    def release(self) -> None: ...


CONTEXT_DROPPED_HEADER = "x-switchboard-context-dropped"
"""On a reply whose prompt left older messages out to fit the context window (the sliding window, stateless
requests too): how many. OpenAI would have answered such a request 400 context_length_exceeded."""


class Exchange:
    """A request's slot, rate-limit grant, in-flight gauge, metrics and span; see the module docstring."""

    def __init__(self, metrics: GatewayMetrics, limiter: RateLimiter, span: trace.Span, request_id: str,
                 disconnect: DisconnectWatch, on_record: Callable[[Outcome], None] | None = None,
                 t0: float | None = None, level: int = 0) -> None:
        self.metrics = metrics
        self.span = span
        self.request_id = request_id
        self.disconnect = disconnect
        self.t0 = time.monotonic() if t0 is None else t0
        self.tier_name = "unknown"
        self.grant: Grant | None = None
        self.ticket: Ticket | None = None
        self.first_token_at: float | None = None
        """Monotonic time the shard's first token arrived."""
        self.first_content_at: float | None = None
        """Monotonic time the first content left for the client (after the output filter)."""
        self.used_tokens: int | None = None
        """Real usage once the shard reported it (settles the rate limit and the fair share)."""
        self.context_dropped = 0
        """Messages the sliding window left out of the prompt (CONTEXT_DROPPED_HEADER tells the client)."""
        # what the Outcome reports, set by the phase that learns it
        self.level = level
        self.key_id = ""
        self.tenant = ""
        self.session_id: str | None = None
        self.output_kind = "text"
        self.model = ""
        self.shard = ""
        self.usage: Usage | None = None
        """As the stream last reported it (data_plane/gateway/stream.py Completion)."""
        self.tool_calls = 0
        self.hold: Hold | None = None
        """The request's place among its key's requests in flight (a revocation ends it; released at close)."""
        self.stopped_as: Callable[[], tuple[int, str] | None] = lambda: None
        """Why the server, not the client, ended a request whose receiving end left (a background run its
        gateway's shutdown or time limit stopped, data_plane/gateway/responses_detached.py): its status and
        code, or None (the client left)."""
        self._limiter = limiter
        self._on_record = on_record
        self._inflight = False
        self._closed = False

    @property
    def trace_id(self) -> str:
        """This request's trace id (hex), for error bodies and headers."""
        return format(self.span.get_span_context().trace_id, "032x")

    @property
    def client_gone(self) -> bool:
        return self.disconnect.gone

    @property
    def gone_as(self) -> tuple[int, str]:
        """The status and code of a request whose receiving end left: 499 ``client_disconnected``, unless
        the server stopped it (`stopped_as`), which is counted, billed and logged as what it was."""
        return self.stopped_as() or (CLIENT_CLOSED_STATUS, CLIENT_DISCONNECTED)

    def close_gone(self) -> str:
        """`close` a request whose receiving end left, as `gone_as` says; returns its code."""
        status, code = self.gone_as
        self.span.set_attribute("error.type", code)
        self.close(status, code)
        return code

    @property
    def closed(self) -> bool:
        return self._closed

    def dropped_context(self, messages: int) -> None:
        self.context_dropped = messages
        self.span.set_attribute("switchboard.context.dropped_messages", messages)

    def headers(self) -> dict[str, str]:
        """The reply's own headers: its id, the rate limit's, and how many older messages the window left out."""
        dropped = {CONTEXT_DROPPED_HEADER: str(self.context_dropped)} if self.context_dropped else {}
        return {"X-Request-Id": self.request_id, **(self.grant.headers if self.grant else {}), **dropped}

    def admitted(self, ticket: Ticket) -> None:
        """Hold an in-flight slot (the in-flight gauge counts it until `close`)."""
        self.ticket = ticket
        self.metrics.inflight.labels(self.tier_name).inc()
        self._inflight = True

    def outcome(self, status: int, code: str = OK) -> Outcome:
        """What the request came to, ending now with `status` and `code`. A request answered with a 5xx
        (the server failed it: the client got an error, no output) uses no tokens, whatever a shard produced
        first: OpenAI bills no failed request, and the gateway's token counters (`switchboard_gateway_tokens`)
        never counted them. A stream is answered 200 once it opened: what it sent is billed, as its usage said."""
        usage = self.usage if status < 500 else None
        details = usage.prompt_tokens_details if usage is not None else None
        first = self.first_token_at
        return Outcome(
            request_id=self.request_id, trace_id=self.trace_id, status=status, code=code, tier=self.tier_name,
            key_id=self.key_id, tenant=self.tenant, model=self.model, shard=self.shard,
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            cached_tokens=details.cached_tokens if details is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            ttft_s=None if first is None else round(first - self.t0, 6),
            latency_s=round(time.monotonic() - self.t0, 6), degradation_level=self.level,
            session=self.session_id is not None, output_kind=self.output_kind, tool_calls=self.tool_calls)

    def close(self, status: int | None, code: str = OK) -> Outcome | None:
        """Release everything, once: the request's Outcome built, counted with `status`/`code` and
        recorded (not when `status` is None: the server, not the request, ended it), the in-flight
        gauge down, the admission slot freed, the token estimate settled (all refunded if no shard
        started, real usage once known, kept if the stream broke before usage came; the request itself
        refunded too when the server failed it, a 5xx, before a shard started), the span ended.
        Returns the Outcome (None on a second call, or when `status` is None)."""
        if self._closed:
            return None
        self._closed = True
        if self.hold is not None:
            self.hold.release()
        outcome = None
        if status is not None:
            outcome = self.outcome(status, code)
            self.metrics.requests.labels(self.tier_name, str(status), request_code(code)).inc()
            if self._on_record is not None:  # spooled before the reply's last byte (data_plane/ledger/writer.py)
                self._on_record(outcome)
        if self._inflight:
            self.metrics.inflight.labels(self.tier_name).dec()
        used = self.used_tokens if self.used_tokens is not None else (None if self.first_token_at else 0)
        if self.ticket is not None:  # the real tokens settle the tenant's fair share (estimate if unknown)
            self.ticket.release(used)
        if self.grant is not None and used is not None:  # a 5xx before any work: the request back too
            self._limiter.settle_later(self.grant, used, refund_request=used == 0 and (status or 0) >= 500)
        self.span.end()
        return outcome
