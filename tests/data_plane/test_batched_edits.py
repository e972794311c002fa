"""Concurrent edits of a tenant's stored-completions index, applied by one rewrite per batch
(data_plane/gateway/batched_edits.py, chat_store.edit_index), against an in-memory store."""

from __future__ import annotations

import asyncio
import copy
import time
from types import SimpleNamespace
from typing import Any

import pytest

from data_plane.common.errors import NotFound, Overloaded, SwitchboardError
from data_plane.gateway.batched_edits import BatchedEdits
from data_plane.gateway.chat_store import edit_index, load_index
from data_plane.gateway.record_locks import RecordLocks
from data_plane.gateway.response_store import Record

NOW = int(time.time())


class SlowStore:
    """A conversation store whose save takes a while, as a big index's rewrite does."""

    ttl_s = 86_400.0

    def __init__(self, save_s: float = 0.05) -> None:
        self.record: Record | None = None
        self.saves = 0
        self.save_s = save_s
        self.fail = False

    async def load(self, record_id: str, owner: str, replicas: int, kind: Any = None) -> Record:
        if self.record is None:
            raise NotFound("no index yet")
        return copy.deepcopy(self.record)

    async def save(self, record: Record, owner: str, replicas: int) -> None:
        await asyncio.sleep(self.save_s)
        if self.fail:
            raise Overloaded("cache node down", code="cache_unavailable")
        self.saves += 1
        self.record = copy.deepcopy(record)


def _gateway() -> Any:
    return SimpleNamespace(record_locks=RecordLocks(), index_edits=BatchedEdits())


def _entry(i: int) -> dict[str, Any]:
    return {"id": f"chatcmpl-{i}", "created": NOW + i, "model": "m", "metadata": {}}


def test_concurrent_stores_of_one_tenant_are_one_rewrite_per_batch_and_none_is_lost() -> None:
    """50 concurrent `store: true` completions of one tenant made 50 rewrites of its index in a row (~0.25 s
    each at 11,000 entries), and those that waited past 5 s for the lock were not stored at all."""
    async def main() -> None:
        gw, store = _gateway(), SlowStore()
        await asyncio.gather(*(edit_index(gw, store, "tenant:acme", 2, add=_entry(i)) for i in range(50)))
        index = await load_index(store, "tenant:acme", 2)  # type: ignore[arg-type]
        assert [e["id"] for e in index.items] == [f"chatcmpl-{i}" for i in range(50)]
        assert store.saves <= 2, store.saves  # the first alone, then everyone who arrived meanwhile
        assert len(gw.index_edits) == 0  # nothing kept once idle
        # an update and a delete meeting in one batch both apply, in order
        await asyncio.gather(edit_index(gw, store, "tenant:acme", 2, add={**_entry(3), "metadata": {"k": "v"}}),
                             edit_index(gw, store, "tenant:acme", 2, remove="chatcmpl-4"))
        index = await load_index(store, "tenant:acme", 2)  # type: ignore[arg-type]
        by_id = {e["id"]: e for e in index.items}
        assert by_id["chatcmpl-3"]["metadata"] == {"k": "v"} and by_id["chatcmpl-4"].get("deleted") is True
        assert [e["id"] for e in index.items] == [f"chatcmpl-{i}" for i in range(50)]  # places kept

    asyncio.run(main())


def test_a_failed_rewrite_fails_every_edit_of_its_batch_and_the_next_batch_still_runs() -> None:
    async def main() -> None:
        gw, store = _gateway(), SlowStore()
        await edit_index(gw, store, "tenant:acme", 1, add=_entry(0))
        store.fail = True
        results = await asyncio.gather(*(edit_index(gw, store, "tenant:acme", 1, add=_entry(i)) for i in (1, 2, 3)),
                                       return_exceptions=True)
        assert all(isinstance(r, SwitchboardError) for r in results), results
        store.fail = False
        await edit_index(gw, store, "tenant:acme", 1, add=_entry(4))
        index = await load_index(store, "tenant:acme", 1)  # type: ignore[arg-type]
        assert [e["id"] for e in index.items] == ["chatcmpl-0", "chatcmpl-4"]

    asyncio.run(main())


def test_a_caller_that_leaves_does_not_cancel_its_batchs_write() -> None:
    async def main() -> None:
        gw, store = _gateway(), SlowStore(save_s=0.2)
        leaving = asyncio.create_task(edit_index(gw, store, "tenant:acme", 1, add=_entry(0)))
        staying = asyncio.create_task(edit_index(gw, store, "tenant:acme", 1, add=_entry(1)))
        await asyncio.sleep(0.05)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await staying
        index = await load_index(store, "tenant:acme", 1)  # type: ignore[arg-type]
        assert [e["id"] for e in index.items] == ["chatcmpl-0", "chatcmpl-1"]

    asyncio.run(main())
