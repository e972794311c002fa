"""Edits of one record by concurrent requests, applied together by one read-modify-write.

A tenant's stored-completions index (data_plane/gateway/chat_store.py) is one record, rewritten whole
on every store, update and delete: decoding and encoding it took ~0.3 ms at 100 entries and ~250 ms at
11,000. One rewrite at a time under the record lock made N concurrent stores of one tenant N rewrites
in a row: replies slowed as the index grew, and past ITEM_EDIT_WAIT_S (5 s) of waiting a completion was
not stored at all (the client had its 200; a warning said so). Here the edits that arrive while a
rewrite runs wait together, and the next rewrite applies them all: per record, at most one rewrite
running and one batch waiting, however many requests edit it.

    edits = BatchedEdits()
    await edits.apply(key, edit, write)   # write(every edit of the batch) is awaited once per batch

A batch's outcome is each of its callers' (a failed write fails them all, as it would have failed each).
A caller that leaves (its request cancelled) does not take its batch's write with it: the write runs in
a task of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Write = Callable[[list[Any]], Awaitable[None]]


@dataclass
class _Batch:
    edits: list[Any] = field(default_factory=list)
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BatchedEdits:
    """See the module docstring."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Batch] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Records with a rewrite running or waiting (0 when idle: nothing is kept per record)."""
        return len(self._running)

    async def apply(self, key: str, edit: Any, write: Write) -> None:
        """Apply `edit` to the record `key` by `write`, with whatever other edits of it are waiting."""
        batch = self._waiting.get(key)
        if batch is None:
            batch = self._waiting[key] = _Batch()
            batch.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even if nobody waits
            task = asyncio.create_task(self._run(key, batch, write), name="batched-edit")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        batch.edits.append(edit)
        await asyncio.shield(batch.done)

    async def _run(self, key: str, batch: _Batch, write: Write) -> None:
        me = asyncio.current_task()
        assert me is not None
        previous = self._running.get(key)
        self._running[key] = me
        try:
            if previous is not None:
                await asyncio.wait([previous])  # its outcome is its own batch's
            if self._waiting.get(key) is batch:
                del self._waiting[key]  # from here on, new edits form the next batch
            await write(batch.edits)
        except asyncio.CancelledError:
            batch.done.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 -- every caller of the batch gets it
            batch.done.set_exception(exc)
        else:
            batch.done.set_result(None)
        finally:
            if self._running.get(key) is me:
                del self._running[key]
            if self._waiting.get(key) is batch:  # cancelled while it waited for the previous one
                del self._waiting[key]
