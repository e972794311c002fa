"""The API server's HTTP metrics under the names vLLM's server exports (prometheus-fastapi-instrumentator's).

    install_http_metrics(app, registry)       # the shard's FastAPI app: every request it answers is counted

``http_requests_total{handler, method, status}`` counts answered requests, ``status`` the class
(``2xx``... ``5xx``); ``http_request_duration_seconds{handler, method}`` is the time to the end of the
response (a stream: its last byte). ``handler`` is the matched route's path template (``none`` when no
route matched), so the label set is bounded by the app's routes; ``method`` is the HTTP method of a
route that matched (``other`` otherwise). Probes and scrapes (``/metrics``, ``/health``, ``/ready``) are
not counted, as in vLLM. vLLM's Overview dashboard reads these for its 5xx ratio and API server panels,
on the jobs that export ``vllm:num_requests_running``: the shards. (The gateway's chat and Responses
paths bypass FastAPI for speed; its requests are ``switchboard_gateway_requests_total{code}``.)
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from data_plane.common.telemetry import LATENCY_BUCKETS

EXCLUDED = frozenset({"/metrics", "/health", "/ready"})
"""Handlers not counted: scrapes and probes."""
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class HttpMetrics:
    """The two series, on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests", "HTTP requests answered, by route, method and status class.",
                                ["handler", "method", "status"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Time to the end of the response, by route "
                                  "and method.", ["handler", "method"], buckets=LATENCY_BUCKETS, registry=registry)

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        if handler in EXCLUDED:
            return
        method = method if method in METHODS and handler != "none" else "other"
        self.requests.labels(handler, method, f"{min(max(status // 100, 1), 5)}xx").inc()
        self.duration.labels(handler, method).observe(seconds)


class HttpMetricsMiddleware:
    """Pure ASGI middleware (streams pass through untouched) feeding :class:`HttpMetrics`."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the app's route list (routes added later are seen too)

    def handler(self, scope: Scope) -> str:
        """The matched route's path template: FastAPI's routes leave themselves in the scope; a
        plain Starlette route (/metrics, /health) is matched here."""
        route: Any = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] is Match.FULL), None)
        return str(getattr(route, "path", None) or "none")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # an exception before the response started is answered 500 by the error handler

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.observe(self.handler(scope), str(scope.get("method", "")), status,
                                 time.perf_counter() - start)


def install_http_metrics(app: Any, registry: CollectorRegistry) -> HttpMetrics:
    """Count every request `app` (a Starlette / FastAPI app) answers; returns the metrics."""
    metrics = HttpMetrics(registry)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics, routes=app.router.routes)
    return metrics
