"""Process-level telemetry setup: logging, OpenTelemetry SDK, Prometheus exposition.

Entry points call :func:`configure_process` once; components only use the OpenTelemetry
API (``trace.get_tracer(__name__)``) and metric objects handed to them.

    configure_process("switchboard-shard")
    app.add_route("/metrics", guarded_metrics(metrics_endpoint(registry), cluster_token, metrics_token))  # hop_auth

Spans are recorded by the lean tracer of data_plane/common/tracing.py (the OTel API, a fraction of
the SDK's cost per span). They always go to an in-memory ring (:data:`RECENT_SPANS`) served at
``/debug/spans`` so the control plane can assemble recent traces, and are also exported over
OTLP/HTTP (the SDK's batch processor and exporter) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
Sampling follows ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``. An exporter that fails
is logged, never raised.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from starlette.requests import Request
from starlette.responses import Response

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
"""vLLM's first-token / queue-time buckets: the shard's vllm:* histograms and the gateway's own use them."""
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
"""vLLM's end-to-end request latency buckets."""

ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Standard OTel variable: when set, spans are exported over OTLP/HTTP to it."""
ENV_LOG_LEVEL = "SWITCHBOARD_LOG_LEVEL"
"""Log level for every Switchboard process (default INFO)."""
RECENT_SPAN_CAPACITY = 4096

log = logging.getLogger(__name__)


class SpanRing:
    """A bounded, thread-safe ring of finished spans (with the service that made them).

    Spans are turned into dicts only when read, so the request path pays for an append, not a
    conversion (~0.1 ms a span).
    """

    def __init__(self, capacity: int = RECENT_SPAN_CAPACITY) -> None:
        self._spans: collections.deque[tuple[Any, str]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, span: Any, service: str) -> None:
        with self._lock:
            self._spans.append((span, service))

    def snapshot(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            entries = list(self._spans)
        return [_span_to_dict(span, service) for span, service in entries
                if not trace_id or format(span.get_span_context().trace_id, "032x") == trace_id]


RECENT_SPANS = SpanRing()


def _span_to_dict(span: Any, service: str) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "name": span.name,
        "service": service,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: v for k, v in (span.attributes or {}).items()},
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


_configured = False


def configure_logging() -> None:
    level = os.environ.get(ENV_LOG_LEVEL, "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per heartbeat and per proxied call would drown the real events.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def configure_process(service_name: str) -> None:
    """Configure logging and the OpenTelemetry SDK for this process (idempotent)."""
    global _configured
    configure_logging()
    if _configured:
        return
    _configured = True
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("OTEL_SDK_DISABLED=true: tracing is off")
        return
    try:
        from opentelemetry import trace

        from data_plane.common.tracing import LeanSpan, LeanTracerProvider, readable

        export: Callable[[LeanSpan], None] | None = None
        if os.environ.get(ENV_OTLP_ENDPOINT):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            resource = Resource.create({"service.name": service_name})
            scope = InstrumentationScope("switchboard")
            batch = BatchSpanProcessor(OTLPSpanExporter())  # its own thread; drops when full, never blocks

            def export(span: LeanSpan) -> None:
                batch.on_end(readable(span, resource, scope))

            log.info("exporting spans over OTLP to %s", os.environ[ENV_OTLP_ENDPOINT])

        def sink(span: LeanSpan) -> None:
            # Into the ring as they are (converted to dicts only when read), then to OTLP.
            RECENT_SPANS.add(span, service_name)
            if export is not None:
                export(span)

        trace.set_tracer_provider(LeanTracerProvider(sink))
    except Exception:  # telemetry must never stop a process from serving
        log.exception("OpenTelemetry setup failed; continuing without tracing")


_WITH_PROCESS: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()


def add_process_collector(registry: CollectorRegistry) -> None:
    """The standard ``process_*`` metrics (CPU seconds, resident memory, open fds, start time) on
    `registry`, once: the "Instances" panels of vLLM's and everyone's dashboards read them."""
    if registry not in _WITH_PROCESS:
        _WITH_PROCESS.add(registry)
        ProcessCollector(registry=registry)


def metrics_endpoint(registry: CollectorRegistry) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint serving `registry` in the Prometheus text format (with the ``process_*``
    metrics: :func:`add_process_collector`)."""
    add_process_collector(registry)

    async def _metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return _metrics


async def recent_spans_endpoint(request: Request) -> Response:
    import json

    trace_id = request.query_params.get("trace_id")
    return Response(json.dumps(RECENT_SPANS.snapshot(trace_id)), media_type="application/json")


def fastapi_options() -> dict[str, Any]:
    """Keyword arguments for every FastAPI app we build.

    Newer FastAPI traces every request natively once a tracer provider exists. Our processes
    create their own spans with the request's meaning (`gateway.request`, `shard.generate`, ...)
    parented on the caller's `traceparent`; FastAPI's would add three spans per request, start
    separate traces for heartbeats and scrapes, and cost ~0.35 ms per request in the gateway.
    """
    import inspect

    from fastapi import FastAPI

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    return {}
