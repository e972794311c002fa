"""The cluster token on internal hops: one bearer check for every process's internal routes.

    token = cluster_token_from_env()                    # SWITCHBOARD_CLUSTER_TOKEN, None when unset
    headers = cluster_headers(token)                    # {"authorization": "Bearer ..."} or {}
    check = require_cluster_token(token, "cache node")  # a FastAPI dependency: 401 without it
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, token))

What needs it: registering in the embedded registry (control_plane/registry/embedded.py), a cache node's
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


def refuse(request: Request, what: str) -> AuthenticationError:
    client = request.client.host if request.client else "?"
    log.warning("refused %s %s from %s: no valid cluster token", request.method, request.url.path, client)
    return AuthenticationError(f"{what} needs the cluster token: send 'Authorization: Bearer "
                               f"<{CLUSTER_TOKEN_ENV}>'", code="invalid_cluster_token",
                               headers={"WWW-Authenticate": "Bearer"})


def require_cluster_token(token: str | None, what: str,
                          on_refused: Callable[[Request], None] | None = None) -> Callable[[Request], None]:
    """A FastAPI dependency: with a token, ``Authorization: Bearer <it>`` or 401; without, open."""
    expected = token.encode() if token else None

    def check(request: Request) -> None:
        if expected is not None and not bearer_matches(request.headers.get("authorization"), expected):
            if on_refused is not None:
                on_refused(request)
            raise refuse(request, what)

    return check


def guarded(endpoint: Callable[[Request], Awaitable[Response]], token: str | None, what: str = "/debug/spans",
            on_refused: Callable[[Request], None] | None = None) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette route endpoint that answers 401 (OpenAI-shaped) without the cluster token."""
    check = require_cluster_token(token, what, on_refused)

    async def wrapped(request: Request) -> Any:
        try:
            check(request)
        except AuthenticationError as exc:
            from fastapi.responses import JSONResponse

            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        return await endpoint(request)

    return wrapped
