"""Bearer tokens, checked one way in every process: the cluster token on internal hops, and the
admin token on the control plane's ``/admin/v1``.

    token = cluster_token_from_env()                    # SWITCHBOARD_CLUSTER_TOKEN, None when unset
    headers = cluster_headers(token)                    # {"authorization": "Bearer ..."} or {}
    check = require_cluster_token(token, "cache node")  # a FastAPI dependency: 401 without it
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, token))
    admin = RequireBearer(admin_token, "the admin API", closed_without_token="...")  # closed when unset

`RequireBearer` is the one mechanism (constant-time compare, OpenAI-shaped 401 with
``WWW-Authenticate: Bearer``, a warning with the caller's address, an `on_refused` hook for a
counter); `require_cluster_token` is it for the cluster token, open without one.

What needs it: registering in the embedded registry (control_plane/registry/embedded.py), a shard's
chat API (generation and token counts: the gateway's `Upstream` presents it), a cache node's
`/v1/sessions/*`, and `/debug/spans` on every process (spans carry ids and timings an outsider
has no business reading). With no token configured a process runs open (and says so at start),
as a single-machine dev setup without `switchboard up` would. Comparison is constant-time.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from data_plane.common.errors import AuthenticationError

log = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = "SWITCHBOARD_CLUSTER_TOKEN"


def cluster_token_from_env() -> str | None:
    """The cluster token every process of a cluster shares (None when unset)."""
    return os.environ.get(CLUSTER_TOKEN_ENV) or None


def cluster_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def bearer_matches(authorization: str | None, expected: bytes) -> bool:
    """Whether an Authorization header value is ``Bearer <expected>`` (constant time)."""
    scheme, _, presented = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), expected)


class RequireBearer:
    """A FastAPI dependency (``Depends(RequireBearer(...))``, async: no thread per request) that
    lets a request through only with ``Authorization: Bearer <token>``; `check` is the same test
    for plain Starlette endpoints. Without a token: open, or refused with `closed_without_token`
    as the message when one is given."""

    def __init__(self, token: str | None, what: str, *, refused: str | None = None, code: str | None = None,
                 closed_without_token: str | None = None,
                 on_refused: Callable[[Request], None] | None = None) -> None:
        self._expected = token.encode() if token else None
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
            on_refused: Callable[[Request], None] | None = None) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette route endpoint that answers 401 (OpenAI-shaped) without the cluster token."""
    guard = require_cluster_token(token, what, on_refused)

    async def wrapped(request: Request) -> Any:
        try:
            guard.check(request)
        except AuthenticationError as exc:
            from fastapi.responses import JSONResponse

            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        return await endpoint(request)

    return wrapped
