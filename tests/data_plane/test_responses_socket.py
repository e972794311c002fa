"""The WebSocket mode's frame loop (data_plane/gateway/responses_socket.py) against a stand-in for the gateway's
ASGI app: the socket's own rules, without a shard (the whole path, with the SDKs: test_agents_loops.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from data_plane.gateway.responses_socket import MAX_QUEUED_FRAMES, serve_socket

SCOPE: Scope = {"type": "websocket", "path": "/v1/responses", "headers": [], "client": ("127.0.0.1", 1)}


def frame(text: str = "Hi") -> Message:
    return {"type": "websocket.receive", "text": json.dumps({"type": "response.create", "model": "m", "input": text})}


async def test_frames_sent_ahead_past_the_bound_close_the_socket_and_abort_the_response() -> None:
    """A client that sent frame after frame while a response streamed had every one held in memory (each up to
    16 MiB), then served one by one: now the frame past MAX_QUEUED_FRAMES closes the socket (1008), the response
    under way aborts as on a disconnect, and none of the queued frames is served."""
    incoming: asyncio.Queue[Message] = asyncio.Queue()
    for message in [{"type": "websocket.connect"}, frame("0")]:
        incoming.put_nowait(message)
    sent: list[Message] = []
    served: list[Any] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def app(scope: Scope, receive: Receive, send_http: Send) -> None:  # a stream that runs until its client goes
        served.append(json.loads((await receive())["body"])["input"])
        for i in range(1, MAX_QUEUED_FRAMES + 2):  # sent while this one streams
            incoming.put_nowait(frame(str(i)))
        await send_http({"type": "http.response.start", "status": 200, "headers": []})
        await send_http({"type": "http.response.body", "body": b'data: {"type": "response.created"}\n\n',
                         "more_body": True})
        assert (await receive())["type"] == "http.disconnect"

    await asyncio.wait_for(serve_socket(app, lambda request: None, SCOPE, incoming.get, send), timeout=5)
    assert served == ["0"]
    assert sent[0] == {"type": "websocket.accept"}
    assert [m["code"] for m in sent if m["type"] == "websocket.close"] == [1008], sent
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "responses-socket-reader"]  # ended, not left


async def test_frames_left_when_the_client_goes_are_not_served() -> None:
    incoming: asyncio.Queue[Message] = asyncio.Queue()
    for message in [{"type": "websocket.connect"}, frame("0")]:
        incoming.put_nowait(message)
    served: list[Any] = []

    async def app(scope: Scope, receive: Receive, send_http: Send) -> None:
        served.append(json.loads((await receive())["body"])["input"])
        incoming.put_nowait(frame("1"))  # sent while this one runs, then the client goes
        incoming.put_nowait({"type": "websocket.disconnect"})
        await receive()

    async def send(message: Message) -> None:
        pass

    await asyncio.wait_for(serve_socket(app, lambda request: None, SCOPE, incoming.get, send), timeout=5)
    assert served == ["0"]


async def test_a_frame_the_parser_cannot_take_is_an_error_frame_and_the_socket_serves_on() -> None:
    """A frame nested past the parser's stack (100k arrays) raised RecursionError out of the frame loop: the socket
    ended with no close frame and a traceback in the log. NaN and 1e400, which Python's parser takes and no encoder
    writes back, went on into the POST. Each is now a 400 error frame, and the next frame is served."""
    deep = '{"type": "response.create", "input": ' + "[" * 100_000 + "]" * 100_000 + "}"
    incoming: asyncio.Queue[Message] = asyncio.Queue()
    for message in [{"type": "websocket.connect"}, {"type": "websocket.receive", "text": deep},
                    {"type": "websocket.receive", "text": '{"type": "response.create", "input": "a", "top_p": NaN}'},
                    {"type": "websocket.receive", "bytes": b'{"type": "response.create", "input": "a", "top_p": 1e400}'},
                    frame("after")]:
        incoming.put_nowait(message)
    sent: list[Message] = []
    served: list[Any] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def app(scope: Scope, receive: Receive, send_http: Send) -> None:
        served.append(json.loads((await receive())["body"])["input"])
        await send_http({"type": "http.response.start", "status": 200, "headers": []})
        await send_http({"type": "http.response.body", "body": b'data: {"type": "response.completed"}\n\n'})
        incoming.put_nowait({"type": "websocket.disconnect"})

    await asyncio.wait_for(serve_socket(app, lambda request: None, SCOPE, incoming.get, send), timeout=30)
    assert served == ["after"]
    errors = [json.loads(m["text"]) for m in sent if m["type"] == "websocket.send" and '"error"' in m["text"][:20]]
    assert [(e["status"], e["error"]["code"]) for e in errors] == [(400, "invalid_json")] * 3, errors
    assert "nested too deeply" in errors[0]["error"]["message"]
    assert "NaN" in errors[1]["error"]["message"] and "out of range" in errors[2]["error"]["message"]
