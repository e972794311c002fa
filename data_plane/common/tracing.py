"""A lean OpenTelemetry tracer: the OTel *API*, spans recorded at a fraction of the SDK's cost.

    provider = LeanTracerProvider("switchboard-gateway", sink=ring_and_otlp)
    trace.set_tracer_provider(provider)       # components keep using trace.get_tracer(__name__)

Why: the gateway opens six spans per chat request. With the SDK's `Span` (locks, bounded
attribute maps, sampler objects, a `ReadableSpan` copy at every end) tracing cost ~0.4 ms of
the gateway's ~1.7 ms of CPU per request, measured with `OTEL_SDK_DISABLED` on and off. A
`LeanSpan` is a slotted record: attributes are a dict, events a list, and `end()` hands the
span to one sink. Everything that reads spans still sees the OTel API (`get_span_context`,
`trace.get_current_span`, W3C propagation), and when OTLP export is configured each finished
span is converted to the SDK's `ReadableSpan` for its `BatchSpanProcessor` (see
data_plane/common/telemetry.py), so exporters and collectors see ordinary spans.

Sampling follows the standard variables: `OTEL_TRACES_SAMPLER` (`always_on`, `always_off`,
`traceidratio`, `parentbased_always_on` (default), `parentbased_always_off`,
`parentbased_traceidratio`) and `OTEL_TRACES_SAMPLER_ARG` (the ratio). Unsampled requests
get a non-recording span that still propagates the trace id.
"""

from __future__ import annotations

import logging
import os
import random
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.status import Status, StatusCode

log = logging.getLogger(__name__)

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_EMPTY_STATE = TraceState()
_UNSET = Status(StatusCode.UNSET)
_TRACE_ID_LIMIT = (1 << 64) - 1


class SpanEvent(NamedTuple):
    name: str
    timestamp: int
    attributes: Mapping[str, Any]


class LeanSpan(trace.Span):
    """A recording span; not thread-safe (each is used by one request's task)."""

    __slots__ = (
        "_context",
        "_sink",
        "attributes",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "start_time",
        "status",
    )

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
                 attributes: Mapping[str, Any] | None, links: Sequence[Link] | None, start_time: int | None,
                 sink: Callable[[LeanSpan], None]) -> None:
        self.name = name
        self._context = context
        self.parent = parent
        self.kind = kind
        self.attributes: dict[str, Any] = {k: v for k, v in attributes.items() if v is not None} if attributes else {}
        self.events: list[SpanEvent] = []
        self.links: tuple[Link, ...] = tuple(links) if links else ()
        self.start_time = start_time or time.time_ns()
        self.end_time: int | None = None
        self.status = _UNSET
        self._sink = sink

    def get_span_context(self) -> SpanContext:
        return self._context

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None and value is not None:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is None:
            self.attributes.update((k, v) for k, v in attributes.items() if v is not None)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self.end_time is None:
            self.events.append(SpanEvent(name, timestamp or time.time_ns(), dict(attributes or {})))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links = (*self.links, Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return  # OK is final, as in the SDK
        if isinstance(status, Status):
            self.status = status
        else:
            self.status = Status(status, description if status is StatusCode.ERROR else None)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        event = {"exception.type": type(exception).__qualname__, "exception.escaped": str(escaped)}
        if refused_input(exception):  # its words quote the request: its code says what went wrong
            event["error.type"] = str(getattr(exception, "code", None) or type(exception).__name__)
        else:
            event["exception.message"] = str(exception)
            event["exception.stacktrace"] = "".join(traceback.format_exception(exception))
        event.update(attributes or {})
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        try:
            self._sink(self)
        except Exception:  # a failing sink must never fail a request
            log.debug("span sink failed", exc_info=True)

    def __repr__(self) -> str:
        return f"LeanSpan({self.name!r}, trace_id={self._context.trace_id:032x})"


def refused_input(exc: BaseException) -> bool:
    """An error that refuses what a client sent (a 4xx, a body that does not validate): its message quotes
    the input (OpenAI's "Invalid value: 'X'", a schema's type, a regex; pydantic's errors carry the whole
    body, a cache node's put the transcript), so a span records its type and code, never its words; the
    client was told them."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    status = getattr(exc, "status", None)
    return (isinstance(status, int) and status < 500) or isinstance(exc, (ValidationError, RequestValidationError)) \
        or (isinstance(exc, HTTPException) and exc.status_code < 500)


class _CurrentSpan:
    """`start_as_current_span`'s context manager: the span is current inside, ended on exit."""

    __slots__ = ("_end", "_record", "_set_status", "_token", "span")

    def __init__(self, span: trace.Span, record_exception: bool, set_status_on_exception: bool,
                 end_on_exit: bool) -> None:
        self.span = span
        self._record = record_exception
        self._set_status = set_status_on_exception
        self._end = end_on_exit
        self._token: object | None = None

    def __enter__(self) -> trace.Span:
        self._token = context_api.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is not None and self.span.is_recording():
                if self._record:
                    self.span.record_exception(exc)
                if self._set_status:
                    self.span.set_status(Status(StatusCode.ERROR, type(exc).__name__ if refused_input(exc)
                                                else f"{type(exc).__name__}: {exc}"))
        finally:
            context_api.detach(self._token)  # type: ignore[arg-type]
            if self._end:
                self.span.end()


class Sampler(NamedTuple):
    ratio: float
    """Share of new traces recorded (1.0: all)."""
    parent_based: bool
    """Follow the caller's sampled flag when there is a caller."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Sampler:
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = min(1.0, max(0.0, float(arg))) if arg else 1.0
        except ValueError:
            log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number; sampling everything", arg)
            ratio = 1.0
        table = {
            "always_on": cls(1.0, False), "always_off": cls(0.0, False), "traceidratio": cls(ratio, False),
            "parentbased_always_on": cls(1.0, True), "parentbased_always_off": cls(0.0, True),
            "parentbased_traceidratio": cls(ratio, True),
        }
        if name not in table:
            log.warning("OTEL_TRACES_SAMPLER=%r is not supported here; using parentbased_always_on", name)
            return table["parentbased_always_on"]
        return table[name]

    def sampled(self, trace_id: int, parent: SpanContext | None) -> bool:
        if self.parent_based and parent is not None:
            return parent.trace_flags.sampled
        if self.ratio >= 1.0:
            return True
        # The same rule as the SDK's TraceIdRatioBased: the low 64 bits against a bound.
        return (trace_id & _TRACE_ID_LIMIT) < round(self.ratio * (_TRACE_ID_LIMIT + 1))


class LeanTracer(trace.Tracer):
    def __init__(self, sink: Callable[[LeanSpan], None], sampler: Sampler) -> None:
        self._sink = sink
        self._sampler = sampler
        self._rand = random.Random()

    def start_span(self, name: str, context: context_api.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = None,
                   start_time: int | None = None, record_exception: bool = True,
                   set_status_on_exception: bool = True) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        span_id = self._rand.getrandbits(64) or 1
        if parent.is_valid:
            trace_id, state, parent_ctx = parent.trace_id, parent.trace_state, parent
        else:
            trace_id, state, parent_ctx = self._rand.getrandbits(128) or 1, _EMPTY_STATE, None
        if not self._sampler.sampled(trace_id, parent_ctx):
            return NonRecordingSpan(SpanContext(trace_id, span_id, False, NOT_SAMPLED, state))
        return LeanSpan(name, SpanContext(trace_id, span_id, False, SAMPLED, state), parent_ctx, kind,
                        attributes, links, start_time, self._sink)

    def start_as_current_span(self, name: str, context: context_api.Context | None = None,  # type: ignore[override]
                              kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
                              links: Sequence[Link] | None = None, start_time: int | None = None,
                              record_exception: bool = True, set_status_on_exception: bool = True,
                              end_on_exit: bool = True) -> _CurrentSpan:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return _CurrentSpan(span, record_exception, set_status_on_exception, end_on_exit)


class LeanTracerProvider(trace.TracerProvider):
    """One tracer for the whole process (the instrumentation scope is not recorded)."""

    def __init__(self, sink: Callable[[LeanSpan], None], sampler: Sampler | None = None) -> None:
        self._tracer = LeanTracer(sink, sampler or Sampler.from_env())

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Any = None) -> trace.Tracer:
        return self._tracer


def readable(span: LeanSpan, resource: Any, scope: Any) -> Any:
    """The SDK's `ReadableSpan` for a finished lean span (for the OTLP exporter)."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import Event, ReadableSpan

    return ReadableSpan(
        name=span.name, context=span.get_span_context(), parent=span.parent, resource=resource,
        attributes=BoundedAttributes(attributes=span.attributes, immutable=True),  # drops invalid values
        events=tuple(Event(e.name, BoundedAttributes(attributes=e.attributes, immutable=True), e.timestamp)
                     for e in span.events),
        links=span.links, kind=span.kind, status=span.status, start_time=span.start_time,
        end_time=span.end_time, instrumentation_scope=scope,
    )
