"""Bearer tokens, checked one way in every process: the cluster token on internal hops, and the
admin token on the control plane's ``/admin/v1``.

    token = cluster_token_from_env()                    # SWITCHBOARD_CLUSTER_TOKEN, None when unset
    headers = cluster_headers(token)                    # {"authorization": "Bearer ..."} or {}
    check = require_cluster_token(token, "cache node")  # a FastAPI dependency: 401 without it
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, token))
    app.add_route("/metrics", guarded_metrics(view, token, metrics_token_from_env()))  # either opens it
    headers = scrape_headers(token, metrics_token)      # what a scraper presents: the metrics token, else the cluster's
    admin = RequireBearer(admin_token, "the admin API", closed_without_token="...")  # closed when unset
    refusals = RefusalMetrics(registry, "shard", ("chat", "debug_spans", "metrics"))  # every route at 0
    app.add_route("/metrics", guarded_metrics(view, token, metrics_token, refusals=refusals))  # counted as "metrics"
    check = require_cluster_token(token, "the shard's chat API", refusals.on("chat"))

`RequireBearer` is the one mechanism (constant-time compare, OpenAI-shaped 401 with
``WWW-Authenticate: Bearer``, a warning with the caller's address, an `on_refused` hook for a
counter); `require_cluster_token` is it for the cluster token, open without one. Every refusal of a
token guard is counted in its process's `switchboard_<process>_refused_total{route}` (`RefusalMetrics`:
`guarded` counts under ``debug_spans``, `guarded_metrics` under ``metrics``); a user's bad API key on the
gateway is not a token guard's refusal (it is switchboard_gateway_requests_total{code}).

What needs it: registering in the embedded registry (control_plane/registry/embedded.py), a shard's
chat API (generation and token counts: the gateway's `Upstream` presents it), a cache node's
`/v1/sessions/*`, and `/debug/spans` on every process (spans carry ids and timings an outsider
has no business reading). With no token configured a process runs open (and says so at start),
as a single-machine dev setup without `switchboard up` would. Comparison is constant-time.

`/metrics` on every process takes the cluster token or the metrics token (SWITCHBOARD_METRICS_TOKEN),
a read-only credential for Prometheus: it opens `/metrics` and nothing else, so a scraper's config that
leaks cannot call a shard (prompts), read a cache node (transcripts) or join the registry. The gateway's
series name tenants and their token volumes (switchboard_admission_tenant_service_tokens), and it serves
them on the public chat port; the other processes' are guarded the same way, one rule for every
scrape target (a series added later with a private label is covered already). Open only when neither
token is set.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import Response

from data_plane.common.errors import AuthenticationError

log = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = "SWITCHBOARD_CLUSTER_TOKEN"
"""The token every process of a cluster shares (internal hops, registration, /debug/spans, /metrics)."""
METRICS_TOKEN_ENV = "SWITCHBOARD_METRICS_TOKEN"
"""A token that opens /metrics only: give it to Prometheus instead of the cluster token (optional)."""
TOKENS_HELP = (f"Tokens come from the environment only: {CLUSTER_TOKEN_ENV}, the cluster's shared secret "
               f"(joining the registry, the hops between processes, /debug/spans), and {METRICS_TOKEN_ENV}, "
               "which opens /metrics and nothing else (Prometheus' credential). /metrics answers 401 to a "
               "caller without 'Authorization: Bearer <either>'; with neither set the process runs open. "
               "`switchboard up` makes both (STATE_DIR/credentials.json).")
"""The part of `switchboard gateway|shard|cache-node --help` that says where their tokens come from."""


class RefusalMetrics:
    """``switchboard_<process>_refused_total{route}``: requests a token guard of `process` refused (a missing or
    wrong cluster or metrics token), by route; every route in `routes` (a fixed set) exists at 0 from start-up.

        refusals = RefusalMetrics(registry, "gateway", ("debug_spans", "metrics"))
        guarded(recent_spans_endpoint, token, refusals=refusals)   # refusals counted under "debug_spans"
        require_cluster_token(token, "the shard's chat API", refusals.on("chat"))
    """

    def __init__(self, registry: CollectorRegistry, process: str, routes: tuple[str, ...]) -> None:
        self.routes = routes
        self.refused = Counter(f"switchboard_{process}_refused_total",
                               "Requests refused for a missing or wrong cluster (or metrics) token, by route "
                               f"({'|'.join(routes)}).", ["route"], registry=registry)
        for route in routes:
            self.refused.labels(route)

    def on(self, route: str) -> Callable[[Request], None]:
        """An `on_refused` hook counting under `route` (one of `routes`: the label set stays bounded)."""
        if route not in self.routes:
            raise ValueError(f"{route!r} is not one of this counter's routes {self.routes}")
        child = self.refused.labels(route)
        return lambda _request: child.inc()


def _hook(on_refused: Callable[[Request], None] | None, refusals: RefusalMetrics | None,
          route: str) -> Callable[[Request], None] | None:
    return on_refused if refusals is None else refusals.on(route)


def cluster_token_from_env() -> str | None:
    """The cluster token every process of a cluster shares (None when unset)."""
    return os.environ.get(CLUSTER_TOKEN_ENV) or None


def metrics_token_from_env() -> str | None:
    """The read-only metrics token (None when unset: /metrics then takes the cluster token alone)."""
    return os.environ.get(METRICS_TOKEN_ENV) or None


def cluster_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def scrape_headers(cluster_token: str | None, metrics_token: str | None = None) -> dict[str, str]:
    """What a scraper sends to /metrics: the metrics token when it has one (least privilege), else the
    cluster token; {} when neither is set (the processes then run open too)."""
    return cluster_headers(metrics_token or cluster_token)


def bearer_matches(authorization: str | None, expected: bytes | tuple[bytes, ...]) -> bool:
    """Whether an Authorization header value is ``Bearer <expected>`` (or any one of several; constant
    time: every candidate is compared)."""
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = presented.strip().encode()
    matched = False
    for token in (expected,) if isinstance(expected, bytes) else expected:
        matched |= hmac.compare_digest(given, token)
    return matched


class RequireBearer:
    """A FastAPI dependency (``Depends(RequireBearer(...))``, async: no thread per request) that
    lets a request through only with ``Authorization: Bearer <token>`` (any one of a tuple of tokens);
    `check` is the same test for plain Starlette endpoints. Without a token: open, or refused with
    `closed_without_token` as the message when one is given."""

    def __init__(self, token: str | None | tuple[str | None, ...], what: str, *, refused: str | None = None,
                 code: str | None = None, closed_without_token: str | None = None,
                 on_refused: Callable[[Request], None] | None = None) -> None:
        tokens = tuple(t.encode() for t in (token if isinstance(token, tuple) else (token,)) if t)
        self._expected = tokens or None
        self._what = what
        self._refused = refused or f"{what} needs a bearer token: send 'Authorization: Bearer <token>'"
        self._code = code
        self._closed = closed_without_token
        self._on_refused = on_refused

    def check(self, request: Request) -> None:
        """Return when the request may pass; raise AuthenticationError (401) otherwise."""
        if self._expected is None:
            if self._closed is None:
                return
            raise AuthenticationError(self._closed, code=self._code, headers={"WWW-Authenticate": "Bearer"})
        if bearer_matches(request.headers.get("authorization"), self._expected):
            return
        if self._on_refused is not None:
            self._on_refused(request)
        client = request.client.host if request.client else "?"
        log.warning("refused %s %s from %s: no valid token for %s", request.method, request.url.path, client,
                    self._what)
        raise AuthenticationError(self._refused, code=self._code, headers={"WWW-Authenticate": "Bearer"})

    async def __call__(self, request: Request) -> None:
        self.check(request)


def require_cluster_token(token: str | None, what: str,
                          on_refused: Callable[[Request], None] | None = None) -> RequireBearer:
    """A FastAPI dependency: with a token, ``Authorization: Bearer <it>`` or 401; without, open."""
    return RequireBearer(token, what, refused=f"{what} needs the cluster token: send 'Authorization: Bearer "
                         f"<{CLUSTER_TOKEN_ENV}>'", code="invalid_cluster_token", on_refused=on_refused)


def guarded(endpoint: Callable[[Request], Awaitable[Response]], token: str | None, what: str = "/debug/spans",
            on_refused: Callable[[Request], None] | None = None, *, refusals: RefusalMetrics | None = None,
            route: str = "debug_spans") -> Callable[[Request], Awaitable[Response]]:
    """A Starlette route endpoint that answers 401 (OpenAI-shaped) without the cluster token; refusals
    counted in `refusals` under `route` when given."""
    return _wrapped(endpoint, require_cluster_token(token, what, _hook(on_refused, refusals, route)))


def guarded_metrics(endpoint: Callable[[Request], Awaitable[Response]], cluster_token: str | None,
                    metrics_token: str | None, on_refused: Callable[[Request], None] | None = None, *,
                    refusals: RefusalMetrics | None = None) -> Callable[[Request], Awaitable[Response]]:
    """`/metrics` behind the metrics token or the cluster token (either opens it): a 401 in the shape
    `guarded` answers, with no series, for anyone else (counted in `refusals` under ``metrics``); open
    when neither token is set."""
    guard = RequireBearer((metrics_token, cluster_token), "/metrics", code="invalid_metrics_token",
                          on_refused=_hook(on_refused, refusals, "metrics"), refused="/metrics needs the metrics or the cluster token: send "
                          f"'Authorization: Bearer <{METRICS_TOKEN_ENV} or {CLUSTER_TOKEN_ENV}>'")
    return _wrapped(endpoint, guard)


def _wrapped(endpoint: Callable[[Request], Awaitable[Response]],
             guard: RequireBearer) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Any:
        try:
            guard.check(request)
        except AuthenticationError as exc:
            from fastapi.responses import JSONResponse

            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        return await endpoint(request)

    return wrapped
