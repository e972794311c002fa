"""Reading a request body the same way in every process: 413 past a size limit (never buffering
more), 408 when the client stalls (slowloris), 400/415 for a JSON body that is not JSON.

    raw = await read_body(request, settings.max_body_bytes)          # gateway, shard: bytes
    body = await read_json_body(request, settings.max_body_bytes)    # cache node: parsed JSON
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)              # control plane (app.py): FastAPI parses

The connection-level half (a client that never sends its first request) is the protocol's job,
see data_plane/common/http_server.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from data_plane.common.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType, render

BODY_TIMEOUT_S = 30.0
"""A client that stops sending its body for this long gets 408 (slowloris)."""


async def read_body(request: Any, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """Read a Starlette request body: 413 past `limit` bytes (never buffering more), 408 when the
    client stalls for `timeout_s`; 415 for a compressed body (no route decodes one: a gzip body was read as
    bytes, and answered "not valid UTF-8")."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding and coding != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {coding[:32]!r} is not supported: send the body uncompressed")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    try:
        # One timer for the whole body, pushed back as each chunk arrives (no Task per chunk).
        async with asyncio.timeout(timeout_s) as deadline:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
                chunks.append(chunk)
                deadline.reschedule(loop.time() + timeout_s)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:.0f} s") from None
    return b"".join(chunks)


def _not_json(constant: str) -> Any:
    """NaN and Infinity, which Python's parser takes and JSON has not: a record stored with an
    `updated_at` of Infinity was a 500 on its PUT and on every GET after (no JSON encoder writes it)."""
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    """A JSON number as a float, refused past a double's range: Python reads 1e400 as inf, which no JSON
    encoder writes back (a tool schema's ``"default": 1e400`` was echoed in a response object: a 500)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def strict_loads(raw: bytes | str) -> Any:
    """`json.loads` for what a client sends: ValueError for NaN, Infinity and numbers past a double's range
    (everything parsed here must encode again), RecursionError past the parser's depth."""
    return json.loads(raw, parse_constant=_not_json, parse_float=_finite)


async def read_json_body(request: Any, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> Any:
    """The request's JSON body (any JSON value): 415 for a non-JSON content type, then as
    `read_body`, then 400 when it does not parse (NaN, Infinity and 1e400 included) or holds a lone surrogate."""
    ctype = request.headers.get("content-type", "")
    if ctype and "json" not in ctype.lower():
        raise UnsupportedMediaType("request body must be application/json")
    raw = await read_body(request, limit, timeout_s)
    try:
        body = strict_loads(raw)
        # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 encoder takes: the node's store was a 500
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("request body contains invalid Unicode (a lone surrogate)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("request body is not valid JSON", code="invalid_json") from None
    except RecursionError:  # a body nested past the parser's stack was a 500 on the cache node
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    return body


class BodyLimit:
    """ASGI middleware: a request body past `limit` bytes is a 413, however a route reads it.

    A route that declares a pydantic body (the control plane's admin and registry routes) has it read and
    parsed by FastAPI *before* its dependencies run, the token check among them: a 150 MB body without
    any token took the control plane from 100 to 408 MB for a 401. A declared Content-Length past the
    limit is answered at once, unread; a chunked body is counted as it arrives and cut past it.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = render(PayloadTooLarge(f"request body exceeds {self.limit} bytes"))
            await response(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI lets an HTTPException through its body parsing; rendered as a 413
                raise HTTPException(413, f"request body exceeds {self.limit} bytes")
            return message

        await self.app(scope, bounded, send)
