"""The gateway's shard client (data_plane/routing/hop_client.py) against real sockets on loopback.

A real synthetic shard answers the normal cases; a small asyncio server that misbehaves on
purpose (closes kept-alive connections, dies mid-body, sends garbage) injects the faults.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from data_plane.routing.hop_client import (
    HIGH_WATER,
    HopConnectError,
    HopDisconnected,
    HopPool,
    HopProtocolError,
    HopTimeout,
)
from tests.support.procs import CLUSTER_HEADERS, METRICS_HEADERS, Service, free_port

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.asyncio(loop_scope="session")  # the pool fixture's loop is the tests' loop


def _body(max_tokens: int = 4, stream: bool = True) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
                       "stream": stream}).encode()


@pytest.fixture(scope="module")
def shard() -> Iterator[Service]:
    # slow enough (16 tokens x 100 ms) that an abort lands before the reply would have ended
    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "100"]) as s:
        yield s


@pytest.fixture
def events() -> list[str]:
    """What the pool reported (on_event), in order."""
    return []


@pytest.fixture
async def pool(events: list[str]) -> AsyncIterator[HopPool]:
    p = HopPool(connect_timeout_s=1.0, on_event=events.append)
    yield p
    await p.aclose()


async def _all_lines(response) -> list[bytes]:  # type: ignore[no-untyped-def]
    out = []
    while lines := await response.lines():
        out += lines
    return out


async def test_streams_a_completion_and_reuses_the_connection(shard: Service, pool: HopPool,
                                                              events: list[str]) -> None:
    texts = []
    for _ in range(3):
        response = await pool.post(shard.url, CHAT, _body(),
                                   {**CLUSTER_HEADERS, "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
        assert response.status == 200
        assert response.header(b"content-type").startswith(b"text/event-stream")
        lines = await _all_lines(response)
        assert lines[-1] == b"data: [DONE]"
        assert all(line.startswith(b"data: ") for line in lines)
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        texts.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]))
        assert response.complete
        response.close()
        assert pool.idle_connections() == 1  # read to the end: back to the pool
    assert len(pool._idle[next(iter(pool._idle))]) == 1
    assert events == ["opened", "reused", "reused"]
    assert texts[0] and texts.count(texts[0]) == 3  # the same prompt, the same deterministic reply


async def test_a_non_200_body_is_read_whole(shard: Service, pool: HopPool) -> None:
    response = await pool.post(shard.url, CHAT, b'{"messages": []}', CLUSTER_HEADERS)
    assert response.status == 400
    error = json.loads(await response.read())["error"]
    assert error["type"] == "invalid_request_error"
    assert pool.idle_connections() == 1


async def test_closing_early_drops_the_connection_and_the_shard_aborts(shard: Service, pool: HopPool) -> None:
    response = await pool.post(shard.url, CHAT, _body(max_tokens=200), CLUSTER_HEADERS)
    assert response.status == 200
    while True:  # up to the first token: the generation is under way
        lines = await response.lines(timeout=5.0)
        assert lines, "the stream ended before its first token"
        if any(b'"content":"' in line and b'"content":""' not in line for line in lines):
            break
    response.close()
    assert pool.idle_connections() == 0  # half-read: never reused
    # the shard notices the disconnect and aborts the generation
    for _ in range(100):
        metrics = (await _get(shard.url + "/metrics", METRICS_HEADERS)).decode()
        if 'finished_reason="abort"' in metrics:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the shard never recorded the aborted request")


async def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    import httpx

    async with httpx.AsyncClient() as client:
        return (await client.get(url, headers=headers)).content


async def test_connect_refused_is_a_connect_error(pool: HopPool, events: list[str]) -> None:
    with pytest.raises(HopConnectError):
        await pool.post(f"http://127.0.0.1:{free_port()}", CHAT, _body(), {})
    assert events == ["connect_error"]


async def test_header_injection_is_refused(shard: Service, pool: HopPool) -> None:
    with pytest.raises(ValueError):
        await pool.post(shard.url, CHAT, _body(), {"traceparent": "x\r\nevil: 1"})


# -- a misbehaving server ------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return True


SSE_OK = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
          b"d\r\ndata: one\r\n\r\n\r\n"  # CRLF line endings inside the body
          b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


async def test_a_kept_alive_connection_the_server_closed_is_retried_fresh(pool: HopPool, events: list[str]) -> None:
    served = []
    closed = asyncio.Event()

    async def once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        served.append(1)
        writer.write(SSE_OK)
        await writer.drain()
        writer.close()  # keep-alive was promised, but the server closes (its idle timeout)
        await writer.wait_closed()
        closed.set()

    server, url = await _serve(once_then_close)
    async with server:
        first = await pool.post(url, CHAT, _body(), {})
        assert await _all_lines(first) == [b"data: one", b"data: [DONE]"]
        first.close()
        await asyncio.wait_for(closed.wait(), 5)  # the server has closed its end; the pooled
        # connection is forgotten (if the client saw the close yet) or found stale on send
        second = await pool.post(url, CHAT, _body(), {})
        assert await _all_lines(second) == [b"data: one", b"data: [DONE]"]
        second.close()
    assert len(served) == 2
    # the pooled connection is either already forgotten (the close arrived) or found stale on send
    assert events in (["opened", "opened"], ["opened", "reused", "stale_retry", "opened"])


async def test_a_stream_cut_mid_body_raises(pool: HopPool) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(SSE_OK[: SSE_OK.index(b"e\r\ndata: [DONE]")])
        await writer.drain()
        writer.close()

    server, url = await _serve(cut)
    async with server:
        response = await pool.post(url, CHAT, _body(), {})
        assert await response.lines() == [b"data: one"]
        with pytest.raises(HopDisconnected):
            await response.lines()
        response.close()
    assert pool.idle_connections() == 0


async def test_garbage_is_a_protocol_error(pool: HopPool) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SMTP READY\r\n\r\n")
        await writer.drain()

    server, url = await _serve(garbage)
    async with server:
        with pytest.raises(HopProtocolError):
            await pool.post(url, CHAT, _body(), {})


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the request, answers nothing."""
    await _read_request(reader)
    await asyncio.sleep(5)


async def test_a_silent_server_can_be_given_up_on(pool: HopPool) -> None:
    server, url = await _serve(_silent)
    async with server:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.post(url, CHAT, _body(), {})
    assert pool.idle_connections() == 0


async def test_a_slow_reader_pauses_the_socket_instead_of_buffering_everything(pool: HopPool) -> None:
    total = 8 * HIGH_WATER

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % total)
        line = b"data: " + b"x" * 1017 + b"\n"
        for _ in range(total // len(line)):
            writer.write(line)
            await writer.drain()
        writer.write(b"\n" * (total - (total // len(line)) * len(line)))
        await writer.drain()

    server, url = await _serve(flood)
    async with server:
        response = await pool.post(url, CHAT, _body(), {})
        await asyncio.sleep(0.3)  # the server writes as fast as the socket lets it
        conn = response._conn
        assert conn is not None and conn.paused
        assert len(conn.buffer) < 2 * HIGH_WATER
        received = sum(len(line) + 1 for line in await _all_lines(response))
        assert received == (total // 1024) * 1024
        response.close()


async def test_silence_past_the_deadline_is_a_timeout_and_drops_the_connection(pool: HopPool,
                                                                                events: list[str]) -> None:
    async def stalls_mid_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(SSE_OK[: SSE_OK.index(b"e\r\ndata: [DONE]")])
        await writer.drain()
        await asyncio.sleep(5)

    server, url = await _serve(stalls_mid_stream)
    async with server:
        with pytest.raises(HopTimeout):  # no headers within the post timeout
            await _silent_headers(pool)
        response = await pool.post(url, CHAT, _body(), {}, timeout=2.0)
        assert await response.lines(timeout=1.0) == [b"data: one"]
        started = asyncio.get_running_loop().time()
        with pytest.raises(HopTimeout):
            await response.lines(timeout=0.3)
        waited = asyncio.get_running_loop().time() - started
        assert 0.3 <= waited < 1.0  # enforced by the pool's sweep (every SWEEP_S)
        response.close()
    assert events.count("timeout") == 2
    assert pool.idle_connections() == 0


async def _silent_headers(pool: HopPool) -> None:
    server, url = await _serve(_silent)
    async with server:
        await pool.post(url, CHAT, _body(), {}, timeout=0.2)


async def test_read_takes_a_body_far_larger_than_the_stream_buffer(pool: HopPool) -> None:
    body = b'{"x": "' + b"y" * (6 * HIGH_WATER) + b'"}'

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: one answer per request on the connection
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                         % len(body))
            writer.write(body)
            await writer.drain()

    server, url = await _serve(big)
    async with server:
        response = await pool.request("GET", url, "/v1/sessions/s1", timeout=2.0)
        await asyncio.sleep(0.2)  # everything arrives while nobody reads: the socket pauses
        assert await response.read(asyncio.get_running_loop().time() + 2.0) == body
        with pytest.raises(HopProtocolError):  # and a limit still holds
            small = await pool.request("GET", url, "/v1/sessions/s1", timeout=2.0)
            await small.read(limit=HIGH_WATER)
