"""Reading a request body the same way in every process: 413 past a size limit (never buffering
more), 408 when the client stalls (slowloris), 400/415 for a JSON body that is not JSON.

    raw = await read_body(request, settings.max_body_bytes)          # gateway, shard: bytes
    body = await read_json_body(request, settings.max_body_bytes)    # cache node: parsed JSON

The connection-level half (a client that never sends its first request) is the protocol's job,
see data_plane/common/http_server.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from data_plane.common.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

BODY_TIMEOUT_S = 30.0
"""A client that stops sending its body for this long gets 408 (slowloris)."""


async def read_body(request: Any, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """Read a Starlette request body: 413 past `limit` bytes (never buffering more), 408 when the
    client stalls for `timeout_s`."""
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


async def read_json_body(request: Any, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> Any:
    """The request's JSON body (any JSON value): 415 for a non-JSON content type, then as
    `read_body`, then 400 when it does not parse."""
    ctype = request.headers.get("content-type", "")
    if ctype and "json" not in ctype.lower():
        raise UnsupportedMediaType("request body must be application/json")
    raw = await read_body(request, limit, timeout_s)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("request body is not valid JSON", code="invalid_json") from None
