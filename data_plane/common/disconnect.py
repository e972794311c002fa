"""Noticing that a client went away, one way for every server: watch the ASGI `receive`.

    watch = DisconnectWatch(receive)     # or request.receive
    raw = await read_body(request, limit)
    watch.start()                        # from here, a disconnect cancels this task
    try:
        ...                              # admission queue, engine, upstream stream: all abort
    except asyncio.CancelledError:
        if not watch.swallow():          # not ours: the server is shutting down
            raise
        ...                              # record the client's departure
    finally:
        watch.stop()                     # before the last write: completing is not a disconnect

Once the body is read, the next `receive` only returns when the client disconnects (or the
response is complete), so one pending `receive` per request is all it costs: no polling. Used by
the gateway's chat path (data_plane/gateway/chat.py) and the shard's non-streaming completions
(data_plane/shard/app.py); Starlette's StreamingResponse does the same for the shard's SSE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import Receive

CLIENT_CLOSED_STATUS = 499
"""Recorded (never sent) when the client left before its answer, as nginx does."""
CLIENT_DISCONNECTED = "client_disconnected"
"""The error code recorded (metrics, span, ledger) for a client that left before its answer."""


class DisconnectWatch:
    """Cancels the task that called `start` when the client disconnects."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watcher: asyncio.Future[Any] | None = None
        self.gone = False
        """True once the client disconnected (and the task was cancelled for it)."""
        self.on_gone: list[Callable[[], None]] = []
        """Called the moment the client is seen leaving, before the cancelled task winds down (which may
        take a while: the shard's stream closed, the turn's bookkeeping)."""

    def start(self) -> None:
        """Watch from now on (call once the body is read; idempotent)."""
        task = asyncio.current_task()
        if task is None or self._watcher is not None:
            return

        def on_message(watcher: asyncio.Future[Any]) -> None:
            if watcher.cancelled() or watcher.exception() is not None or self._watcher is None:
                return
            if watcher.result().get("type") == "http.disconnect":
                self.gone = True
                for callback in self.on_gone:
                    callback()
                task.cancel()

        self._watcher = asyncio.ensure_future(self._receive())
        self._watcher.add_done_callback(on_message)

    def stop(self) -> None:
        """Stop watching (idempotent): before the response's last write."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()

    def swallow(self) -> bool:
        """In an ``except asyncio.CancelledError``: True when the cancellation was this watch's
        (the client left), which is then undone so the task may finish its bookkeeping."""
        if not self.gone:
            return False
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            task.uncancel()
        return True
