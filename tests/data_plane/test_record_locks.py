"""The per-conversation write lock (data_plane/gateway/record_locks.py) on its own: who is refused at
once, who waits, and that nothing is left behind; then two gateways in front of one cluster, where the
lock cannot see the other's turn and the cache nodes' ``only_newer`` write refuses the second. The
one-gateway behaviour (lost turns, a turn sent the moment the last one ends) is
tests/data_plane/test_responses_api.py's.

    .venv/bin/python -m pytest tests/data_plane/test_record_locks.py -q   # ~10 s
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from data_plane.common.errors import InvalidRequest
from data_plane.gateway.record_locks import RecordLocks
from tests.support.chat import assert_openai_error
from tests.support.cluster import KEYS, Cluster, api_keys_env, stored_session
from tests.support.procs import Service

AUTH = {"Authorization": f"Bearer {KEYS['plus']}"}


async def test_a_second_generation_is_refused_after_the_grace_not_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused after GENERATION_GRACE_S (it looks again in case the first one's client just left), never
    after the 5 s an edit may wait: counted in the grace's polls, not wall-clock (a loaded machine's
    scheduler may pass any bound)."""
    from data_plane.gateway import record_locks

    locks = RecordLocks()
    await locks.acquire("k/conv", wait_s=5.0, generation=True)
    polls = 0
    real_sleep = asyncio.sleep

    async def counted(delay: float) -> None:
        nonlocal polls
        polls += 1
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", counted)
    with pytest.raises(InvalidRequest) as e:
        await locks.acquire("k/conv", wait_s=5.0, generation=True)
    monkeypatch.undo()
    assert e.value.code == "conversation_locked"
    assert polls == round(record_locks.GENERATION_GRACE_S / record_locks.GRACE_POLL_S)
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


async def test_a_generation_whose_client_left_is_waited_for_not_refused() -> None:
    """A client that stops a stream and sends its next turn at once: the abandoned turn still holds the lock
    while it winds down (0.1-0.4 s through `up`), and the next turn was refused for it. Its DisconnectWatch
    calls `winding_down` the moment the client is seen leaving: the next turn waits, then holds."""
    from data_plane.common.disconnect import DisconnectWatch

    locks = RecordLocks()
    left = asyncio.Event()

    async def receive() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    async def abandoned_turn() -> None:
        watch = DisconnectWatch(receive)
        await locks.acquire("k/conv", wait_s=5.0, generation=True)
        watch.on_gone.append(lambda: locks.winding_down("k/conv"))
        watch.start()
        try:
            await asyncio.sleep(60)  # generating
        except asyncio.CancelledError:
            assert watch.swallow()
            await asyncio.sleep(0.2)  # winding down: the shard's stream closed, bookkeeping
        finally:
            locks.release("k/conv")

    turn = asyncio.create_task(abandoned_turn())
    await asyncio.sleep(0.05)
    with pytest.raises(InvalidRequest):  # while its client is there: refused at once, as before
        await locks.acquire("k/conv", wait_s=5.0, generation=True)
    left.set()
    await asyncio.sleep(0.01)
    await locks.acquire("k/conv", wait_s=5.0, generation=True)  # the next turn: waits for the end, then holds
    await turn
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


@pytest.fixture(scope="module")
def two_gateways() -> Iterator[tuple[Cluster, Service]]:
    """A synthetic cluster (one shard, two cache nodes, 60 ms a token: a 20-token turn takes 1.2 s, so two
    turns sent at once both load the same version) and a second gateway beside its own, as two gateways
    behind one load balancer are."""
    with (Cluster(shards=1, caches=2, token_delay_ms=60) as c,
          Service(c.gateway.args[3:-2], env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()}) as other):
        yield c, other


def _at_once(*calls: tuple[str, dict, dict]) -> list[httpx.Response]:
    """POST each (url, headers, body) at the same moment; the responses in that order."""
    async def all_of() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(client.post(u, headers={**AUTH, **h}, json=b) for u, h, b in calls)))
    return asyncio.run(all_of())


def test_two_gateways_turns_on_one_session_at_once_store_one_and_refuse_the_other(
        two_gateways: tuple[Cluster, Service]) -> None:
    """Both loaded version 1 and both were answered 200 before: the second save wrote over the first
    (equal versions, last writer wins), so one user's turn and its reply vanished."""
    c, other = two_gateways
    first = httpx.post(c.gateway.url + "/v1/chat/completions", headers={**AUTH, "X-Session-Id": "new"},
                       json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}, timeout=60)
    sid = first.headers["x-session-id"]
    got = _at_once(*((gw.url + "/v1/chat/completions", {"X-Session-Id": sid},
                      {"messages": [{"role": "user", "content": f"turn from {i}"}], "max_tokens": 20})
                     for i, gw in enumerate((c.gateway, other))))
    assert sorted(r.status_code for r in got) == [200, 400], [r.text[:200] for r in got]
    assert_openai_error(next(r for r in got if r.status_code == 400), 400, "conversation_locked")
    winner = next(i for i, r in enumerate(got) if r.status_code == 200)
    reply = got[winner].json()["choices"][0]["message"]["content"]
    for node in c.caches:
        record = stored_session(node.url, sid)
        assert record is not None and record["version"] == 2
        assert [m["content"] for m in record["messages"]][2:] == [f"turn from {winner}", reply]


def test_two_gateways_turns_on_one_conversation_at_once_store_one_and_refuse_the_other(
        two_gateways: tuple[Cluster, Service]) -> None:
    c, other = two_gateways
    conv = httpx.post(c.gateway.url + "/v1/conversations", headers=AUTH, json={}, timeout=30).json()["id"]
    got = _at_once(*((gw.url + "/v1/responses", {}, {"input": f"turn from {i}", "conversation": conv,
                                                      "max_output_tokens": 20})
                     for i, gw in enumerate((c.gateway, other))))
    assert sorted(r.status_code for r in got) == [200, 400], [r.text[:200] for r in got]
    assert_openai_error(next(r for r in got if r.status_code == 400), 400, "conversation_locked")
    winner = next(i for i, r in enumerate(got) if r.status_code == 200)
    items = httpx.get(f"{other.url}/v1/conversations/{conv}/items?order=asc", headers=AUTH, timeout=30).json()["data"]
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("user", f"turn from {winner}"), ("assistant", got[winner].json()["output"][0]["content"][0]["text"])]
