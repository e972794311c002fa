"""The per-conversation write lock (data_plane/gateway/record_locks.py) on its own: who is refused at
once, who waits, and that nothing is left behind. The gateway-level behaviour (lost turns, a turn
sent the moment the last one ends) is tests/data_plane/test_responses_api.py's.

    .venv/bin/python -m pytest tests/data_plane/test_record_locks.py -q   # < 1 s
"""

from __future__ import annotations

import asyncio
import time

import pytest

from data_plane.common.errors import InvalidRequest
from data_plane.gateway.record_locks import RecordLocks


async def test_a_second_generation_is_refused_at_once() -> None:
    locks = RecordLocks()
    await locks.acquire("k/conv", wait_s=5.0, generation=True)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest) as e:
        await locks.acquire("k/conv", wait_s=5.0, generation=True)
    assert e.value.code == "conversation_locked" and time.monotonic() - t0 < 0.5
    locks.release("k/conv")
    assert len(locks) == 0


async def test_a_generation_waits_for_a_compaction_or_an_edit_instead_of_being_refused() -> None:
    locks = RecordLocks()
    await locks.acquire("k/conv", wait_s=0.0)  # background compaction: a short holder

    async def compaction_ends() -> None:
        await asyncio.sleep(0.2)
        locks.release("k/conv")

    ends = asyncio.create_task(compaction_ends())
    await locks.acquire("k/conv", wait_s=5.0, generation=True)  # the next turn: waits, then holds
    await ends
    with pytest.raises(InvalidRequest):  # and now it is a generation that holds it
        await locks.acquire("k/conv", wait_s=5.0, generation=True)
    locks.release("k/conv")
    assert len(locks) == 0


async def test_an_edit_waits_its_limit_then_is_refused_and_leaves_nothing_behind() -> None:
    locks = RecordLocks()
    await locks.acquire("k/conv", wait_s=5.0, generation=True)
    with pytest.raises(InvalidRequest):
        await locks.acquire("k/conv", wait_s=0.1)
    locks.release("k/conv")
    await locks.acquire("k/conv", wait_s=0.0)
    locks.release("k/conv")
    assert len(locks) == 0
