"""What every server shares (data_plane/common): one body reader (413, 408, 415, 400), one error mapper, one disconnect watch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from data_plane.common.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from data_plane.common.http_body import read_body, read_json_body


class _Request:
    """What read_body needs of a Starlette request: headers and stream()."""

    def __init__(self, chunks: list[bytes], headers: dict[str, str] | None = None, stall_after: int | None = None):
        self.headers = headers or {}
        self._chunks = chunks
        self._stall_after = stall_after

    async def stream(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self._chunks):
            if self._stall_after is not None and i >= self._stall_after:
                await asyncio.sleep(3600)
            yield chunk


def test_reads_every_chunk() -> None:
    assert asyncio.run(read_body(_Request([b"ab", b"cd"]), 10)) == b"abcd"


def test_too_large_declared_or_streamed() -> None:
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(_Request([b"x"], {"content-length": "11"}), 10))
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(_Request([b"123456", b"789012"]), 10))


def test_a_stalled_body_is_a_408() -> None:
    with pytest.raises(RequestTimeout):
        asyncio.run(read_body(_Request([b"{", b"}"], stall_after=1), 10, timeout_s=0.05))


def test_json_body_of_the_cache_node_has_the_same_timeout() -> None:
    with pytest.raises(RequestTimeout):
        asyncio.run(read_json_body(_Request([b"{", b"}"], stall_after=1), 10, timeout_s=0.05))
    assert asyncio.run(read_json_body(_Request([b'{"a":', b"1}"]), 100)) == {"a": 1}
    with pytest.raises(InvalidRequest):
        asyncio.run(read_json_body(_Request([b"{"]), 100))
    with pytest.raises(UnsupportedMediaType):
        asyncio.run(read_json_body(_Request([b"{}"], {"content-type": "text/plain"}), 100))


def test_one_error_mapper_for_foreign_exceptions(caplog: pytest.LogCaptureFixture) -> None:
    """Ours pass through untouched; anything else is logged with its traceback and becomes a 500."""
    from data_plane.common.errors import SwitchboardError, as_error

    ours = InvalidRequest("bad")
    assert as_error(ours, "request r1") is ours
    try:
        raise KeyError("boom")
    except KeyError as exc:
        mapped = as_error(exc, "request r2")
    assert type(mapped) is SwitchboardError and mapped.status == 500 and mapped.code == "internal_error"
    record = next(r for r in caplog.records if "request r2: unhandled error" in r.getMessage())
    assert record.exc_info is not None and record.exc_info[0] is KeyError


def test_a_disconnect_cancels_the_watched_task_and_only_that() -> None:
    """One pending receive per request (data_plane/common/disconnect.py): the client leaving cancels
    the task, `swallow` tells that apart from the server's own cancellation."""
    from data_plane.common.disconnect import DisconnectWatch

    async def scenario() -> tuple[bool, bool]:
        leave = asyncio.Event()

        async def receive() -> dict[str, str]:
            await leave.wait()
            return {"type": "http.disconnect"}

        async def handler() -> str:
            watch = DisconnectWatch(receive)
            watch.start()
            try:
                await asyncio.sleep(3600)  # waiting on the engine
                return "finished"
            except asyncio.CancelledError:
                if not watch.swallow():
                    raise
                return "client left"
            finally:
                watch.stop()

        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        leave.set()
        left = await task == "client left"

        leave.clear()
        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        task.cancel()  # the server shutting down: not swallowed
        try:
            await task
            server_cancel_raised = False
        except asyncio.CancelledError:
            server_cancel_raised = True
        return left, server_cancel_raised

    assert asyncio.run(scenario()) == (True, True)
