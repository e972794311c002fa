"""`/v1/responses` over a WebSocket: OpenAI's WebSocket mode, which the Agents SDK uses
(`responses_websocket_session`, `set_default_openai_responses_transport("websocket")`) and the openai SDK's
`client.responses.connect()` opens. Its upgrade was refused (uvicorn's bare 403, the SDK's "server rejected
WebSocket connection: HTTP 403", which reads as a bad key), so an agent on that transport could not start.

    ws = connect("ws://gateway/v1/responses", headers={"Authorization": "Bearer sk-sb-..."})
    ws.send('{"type": "response.create", "model": ..., "input": "Hi"}')   # the body of POST /v1/responses
    ws.recv()  # '{"type": "response.created", ...}', then each event of the stream, the terminal one last

Each `response.create` frame is served as `POST /v1/responses` with `stream: true`, by the same handler
(key, limits, conversations and chains, usage and the ledger: nothing is served differently), and each of
its events goes back as one text frame. A refusal is one `error` frame, `{"type": "error", "status": 429,
"error": {..., "headers": {"retry-after": "1", ...}}}` with OpenAI's error object and the HTTP answer's headers
(the openai SDK's ResponseWsError), and the socket stays open for the next frame. One response at
a time per socket, in the order sent (the SDKs send one and read it to its end; past `MAX_QUEUED_FRAMES`
sent ahead, the socket is closed, 1008); the socket closing aborts the one under way, as a client leaving a
stream does, and serves none of the frames still waiting. The handshake checks the key as any route does: a
bad one is the 401 (or 403, 429) with its OpenAI body, on the HTTP answer to the upgrade.

As OpenAI's, the mode works with `store: false`: the socket keeps its last unstored response's context (the
items it was given and its output), so the next frame's `previous_response_id` naming it goes on from
there (the frame is sent with that context ahead of its input); nothing of it is stored. `background` is
a 400 here, as OpenAI's ("not supported over WebSocket"); `stream` is implicit."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from data_plane.common.errors import InvalidRequest, RateLimited, SwitchboardError, render
from data_plane.common.http_body import strict_loads
from data_plane.common.tasks import stop_tasks
from data_plane.gateway.responses import RESPONSES_PATH
from data_plane.request_checks import check_unicode

FRAME_TYPE = "response.create"
HOP_HEADERS = {b"connection", b"upgrade", b"content-length", b"content-type", b"transfer-encoding"}
"""Headers of the upgrade that are not the POST's (sec-websocket-* go along: nothing reads them)."""


def http_scope(scope: Scope) -> Scope:
    """The scope of the `POST /v1/responses` each frame becomes: the upgrade's client, headers and state."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in HOP_HEADERS]
    return {"type": "http", "asgi": scope.get("asgi", {"version": "3.0"}), "http_version": "1.1",
            "method": "POST", "scheme": "https" if scope.get("scheme") == "wss" else "http",
            "path": RESPONSES_PATH, "raw_path": RESPONSES_PATH.encode(), "root_path": scope.get("root_path", ""),
            "query_string": scope.get("query_string", b""), "client": scope.get("client"),
            "server": scope.get("server"), "state": dict(scope.get("state") or {}),
            "headers": [*headers, (b"content-type", b"application/json")]}


ERROR_HEADERS_LEFT_OUT = {b"content-length", b"content-type"}
"""The HTTP answer's headers an error frame does not carry (they describe the body, which is the frame)."""


def error_frame(status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> str:
    """A refusal as OpenAI's WebSocket mode sends it: the HTTP answer's error object and status, and its headers
    as the error's ``headers`` (the openai SDK's ResponseWsError: "the response headers that were emitted with the
    error"). Without them a 429 over the socket lost Retry-After, retry-after-ms, x-should-retry and the
    x-ratelimit-* headers, and the client could not tell when to send its frame again."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": body.decode("utf-8", "replace")[:500] or "error", "type": "server_error",
                 "param": None, "code": None}
    kept = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers or ()
            if k.lower() not in ERROR_HEADERS_LEFT_OUT}
    if kept and isinstance(error, dict):
        error = {**error, "headers": kept}
    return json.dumps({"type": "error", "status": status, "error": error})


TERMINAL = (b'"response.completed"', b'"response.incomplete"')
MAX_QUEUED_FRAMES = 4
"""Frames a socket may send ahead of the response being served; one more closes it (1008). The SDKs send one
and read it to its end; unbounded, the frames a client sent while a long response streamed (each up to the
server's 16 MiB WebSocket message) were all held in memory, and each served after it."""


class Chain:
    """The socket's last `store: false` response (OpenAI's connection-local state): its id and the items a
    frame chained on it starts from (what it was given, then its output)."""

    def __init__(self) -> None:
        self.last_id: str | None = None
        self.items: list[Any] = []

    def expand(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with its `previous_response_id` replaced by that context, when it names the last response."""
        if self.last_id is None or body.get("previous_response_id") != self.last_id:
            return body
        body = {k: v for k, v in body.items() if k != "previous_response_id"}
        body["input"] = [*self.items, *as_items(body.get("input"))]
        return body

    def keep(self, sent: dict[str, Any], response: dict[str, Any] | None) -> None:
        """After a frame: remember an unstored response's context (a stored one chains the usual way)."""
        if response is None or response.get("store", True) or not isinstance(response.get("id"), str):
            return
        self.last_id = response["id"]
        self.items = [*as_items(sent.get("input")), *(response.get("output") or [])]


def as_items(given: Any) -> list[Any]:
    """A create's `input` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return list(given) if isinstance(given, list) else []


class Exchange:
    """One frame's request, as the Responses handler sees an HTTP client: the body once, then nothing until
    the socket closes (a disconnect: the stream aborts), and its SSE events relayed as text frames."""

    def __init__(self, raw: bytes, relay: Callable[[str], Awaitable[None]], closed: asyncio.Event) -> None:
        self._raw: bytes | None = raw
        self._relay = relay
        self._closed = closed
        self.status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._pending = b""
        self._error: list[bytes] = []
        self.response: dict[str, Any] | None = None
        """The terminal event's Response (completed or incomplete), for the socket's `store: false` chain."""

    async def receive(self) -> Message:
        if self._raw is not None:
            raw, self._raw = self._raw, None
            return {"type": "http.request", "body": raw, "more_body": False}
        await self._closed.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._headers = list(message.get("headers") or [])
            return
        body = message.get("body", b"")
        if self.status != 200:
            self._error.append(body)
            if not message.get("more_body"):
                await self._relay(error_frame(self.status, b"".join(self._error), self._headers))
            return
        *blocks, self._pending = (self._pending + body).split(b"\n\n")
        for block in blocks:
            for line in block.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    if any(kind in line[:64] for kind in TERMINAL):
                        self.response = json.loads(line[6:]).get("response")
                    await self._relay(line[6:].decode("utf-8"))


class OpenSockets:
    """The sockets each API key holds open on this gateway: at most its tier's RPM at once. Without a bound one
    free key opened sockets as fast as it could and left them idle (no frame, so no request charged), each held
    for ever: 150 in a second, and the gateway's connection bound (15,000 by default) would follow, after which
    every tenant's requests were 503 ``overloaded``. A key cannot start more responses a minute than its RPM,
    so more sockets than that would sit idle."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def take(self, key_id: str, limit: int) -> SwitchboardError | None:
        """Count one more socket of `key_id`, or the 429 for one past `limit`."""
        held = self._open.get(key_id, 0)
        if held >= limit:
            return RateLimited(f"this API key holds {held} open WebSockets, its tier's limit: close one, or send "
                               "its requests on the sockets it has", retry_after=1)
        self._open[key_id] = held + 1
        return None

    def give(self, key_id: str) -> None:
        held = self._open.pop(key_id, 1) - 1
        if held > 0:
            self._open[key_id] = held


SOCKETS = OpenSockets()
"""This gateway process's open sockets, by key."""


def _holder(caller: Any) -> tuple[str, int] | None:
    """(key id, its tier's RPM) of what the gateway's `caller` returned, None for anything else."""
    principal, tier = caller if isinstance(caller, tuple) and len(caller) == 2 else (None, None)
    key_id, rpm = getattr(principal, "key_id", None), getattr(tier, "rpm", None)
    return (key_id, rpm) if isinstance(key_id, str) and isinstance(rpm, int) else None


async def serve_socket(app: ASGIApp, caller: Callable[[Request], Any], scope: Scope, receive: Receive,
                       send: Send, sockets: OpenSockets = SOCKETS) -> None:
    """Serve one WebSocket on `/v1/responses` with `app` (the gateway's ASGI app, which serves the POST)."""
    first = await receive()
    if first["type"] != "websocket.connect":
        return
    post = http_scope(scope)
    try:
        holder = _holder(caller(Request(post)))  # the key, bans and throttles: refused on the upgrade's HTTP answer
        if holder is not None and (refused := sockets.take(*holder)) is not None:
            raise refused
    except SwitchboardError as exc:
        await deny(exc, scope, send)
        return
    try:
        await _serve_frames(app, post, receive, send)
    finally:
        if holder is not None:
            sockets.give(holder[0])


async def _serve_frames(app: ASGIApp, post: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "websocket.accept"})
    frames: asyncio.Queue[Message | None] = asyncio.Queue()
    closed = asyncio.Event()

    async def read() -> None:
        while (message := await receive())["type"] != "websocket.disconnect":
            if frames.qsize() >= MAX_QUEUED_FRAMES:
                closed.set()  # the response under way aborts, as on a disconnect
                with contextlib.suppress(OSError, RuntimeError):
                    await send({"type": "websocket.close", "code": 1008, "reason": (
                        f"more than {MAX_QUEUED_FRAMES} frames sent ahead: send {FRAME_TYPE} and read "
                        "its response to its end")})
                break
            frames.put_nowait(message)
        closed.set()
        frames.put_nowait(None)

    async def relay(text: str) -> None:
        if closed.is_set():
            return
        try:
            await send({"type": "websocket.send", "text": text})
        except (OSError, RuntimeError):  # the client went: the exchange's receive now says so
            closed.set()

    reader = asyncio.create_task(read(), name="responses-socket-reader")
    chain = Chain()
    try:
        while (message := await frames.get()) is not None and not closed.is_set():  # none served once closed
            raw = message.get("bytes") or (message.get("text") or "").encode("utf-8")
            body = frame_body(raw)
            if isinstance(body, SwitchboardError):
                await relay(error_frame(body.status, json.dumps(body.body(None, None)).encode()))
                continue
            body = chain.expand(body)
            exchange = Exchange(json.dumps(body).encode(), relay, closed)
            await app(dict(post, state=dict(post["state"])), exchange.receive, exchange.send)
            chain.keep(body, exchange.response)
    finally:
        await stop_tasks(reader)


def frame_body(raw: bytes) -> dict[str, Any] | SwitchboardError:
    """A `response.create` frame as the POST's body (`stream: true`), or the 400 for another frame (or for
    `background`, which OpenAI's WebSocket mode does not take)."""
    try:
        frame = strict_loads(raw)
        check_unicode(frame)  # and that it encodes again: the frame is re-sent as the POST's body
    except InvalidRequest as exc:
        return exc
    except RecursionError:  # a frame nested past the parser's stack ended the socket with a traceback
        return InvalidRequest("a WebSocket frame is nested too deeply", param=None, code="invalid_json")
    except ValueError as exc:  # not JSON, or NaN/Infinity/1e400, which no encoder writes back
        return InvalidRequest(f"a WebSocket frame must be a JSON object: {str(exc)[:128]}", param=None, code="invalid_json")
    if not isinstance(frame, dict) or frame.get("type") != FRAME_TYPE:
        kind = frame.get("type") if isinstance(frame, dict) else None
        return InvalidRequest(f"unsupported frame type {str(kind)[:64]!r}: send {FRAME_TYPE!r}", param="type")
    if frame.get("background"):
        return InvalidRequest("background is not supported over WebSocket", param="background")
    body = {k: v for k, v in frame.items() if k != "type"}
    body["stream"] = True
    return body


async def deny(exc: SwitchboardError, scope: Scope, send: Send) -> None:
    """Refuse the upgrade with the error's HTTP answer (its status and OpenAI body) where the server can send
    one (ASGI's websocket.http.response), else a close before accepting (the server's bare 403)."""
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    response = render(exc)
    await send({"type": "websocket.http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "websocket.http.response.body", "body": response.body})
