"""What a gateway holds of its background responses, in process (data_plane/gateway/responses_background.py):
the events' byte bound, a resume before the held ones, the per-tenant cap, eviction and a stopped run's
disconnect. The processes and the SDK: tests/data_plane/test_responses_background.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.errors import InvalidRequest, RateLimited
from data_plane.gateway.responses_background import CANCELLED, BackgroundMetrics, BackgroundRuns


def event(seq: int, kind: str = "response.output_text.delta", size: int = 100) -> bytes:
    body = {"type": kind, "sequence_number": seq, "delta": "x" * size}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


def runs(**kw: float) -> BackgroundRuns:
    args = {"per_tenant": 2, "max_s": 60.0, "keep_s": 60.0, "event_bytes": 4096, "held": 3} | kw
    return BackgroundRuns(int(args["per_tenant"]), args["max_s"], args["keep_s"], int(args["event_bytes"]),
                          int(args["held"]), BackgroundMetrics(CollectorRegistry()))


async def test_events_are_bounded_and_a_resume_before_them_is_a_400() -> None:
    r = runs()
    run = r.admit("resp_a", "owner", "acme", b"{}")
    await run.send({"type": "http.response.start", "status": 200, "headers": []})
    await run.send({"type": "http.response.body", "body": b"".join(event(i) for i in range(100)), "more_body": True})
    assert run.next_seq == 100 and run.first_seq > 0
    held = sum(len(event(i)) for i in range(run.first_seq, 100))
    assert held <= 4096 and r.metrics.held_bytes._value.get() == held
    with pytest.raises(InvalidRequest) as e:
        run.check_after(run.first_seq - 2)
    assert e.value.param == "starting_after"
    run.check_after(run.first_seq - 1)  # the first held one is the next: fine
    run.ended(None)
    got = [json.loads(e.partition(b"data: ")[2])["sequence_number"] async for e in run.events(97)]
    assert got == [98, 99]


async def test_a_reader_that_falls_behind_ends_with_an_error_event_not_a_hang() -> None:
    run = runs(event_bytes=4096).admit("resp_b", "owner", "acme", b"{}")
    await run.send({"type": "http.response.start", "status": 200, "headers": []})
    await run.send({"type": "http.response.body", "body": event(0), "more_body": True})
    reader = run.events(-1)
    assert b'"sequence_number": 0' in await asyncio.wait_for(reader.__anext__(), 1)
    await run.send({"type": "http.response.body", "body": b"".join(event(i) for i in range(1, 100)),
                    "more_body": True})
    last = await asyncio.wait_for(reader.__anext__(), 1)
    assert b"events_dropped" in last
    with pytest.raises(StopAsyncIteration):
        await reader.__anext__()


async def test_tenant_cap_eviction_and_a_stopped_run_says_disconnect() -> None:
    r = runs(keep_s=0.0)
    a, b = r.admit("resp_1", "o", "acme", b"body"), r.admit("resp_2", "o", "acme", b"")
    with pytest.raises(RateLimited) as e:
        r.admit("resp_3", "o", "acme", b"")
    assert e.value.retry_after and e.value.retry_after >= 1
    r.admit("resp_4", "o", "bigco", b"")  # another tenant
    assert r.get("resp_1", "o") is a and r.get("resp_1", "someone else") is None
    assert await a.receive() == {"type": "http.request", "body": b"body", "more_body": False}
    pending = asyncio.ensure_future(a.receive())
    await asyncio.sleep(0)
    assert not pending.done()
    assert a.stop(CANCELLED) and a.stop_reason == CANCELLED and not a.stop(CANCELLED)
    assert await asyncio.wait_for(pending, 1) == {"type": "http.disconnect"}
    a.response = {"status": "cancelled"}
    a.ended(None)
    r.finished(a)
    r.admit("resp_5", "o", "acme", b"")  # a slot again; the finished one dropped (keep_s 0)
    assert r.get("resp_1", "o") is None and r.get("resp_2", "o") is b
    assert r.metrics.ended.labels("cancelled")._value.get() == 1
    assert r.metrics.ended.labels("refused")._value.get() == 1


def test_no_background_when_turned_off() -> None:
    with pytest.raises(InvalidRequest):
        runs(per_tenant=0).admit("resp_x", "o", "acme", b"")

