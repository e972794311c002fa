"""Background responses (`background: true`) with real processes on loopback, driven by the openai SDK:
a control plane, one synthetic shard (0.5 s a token, its 16-token replies 8 s: a run is still going
when a loaded test acts on it), two cache nodes and a gateway with a cap of 2 background responses per tenant.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_responses_background.py -q

Create returns ``queued`` at once and the run goes on without the connection; retrieve polls it;
cancel aborts the shard's work and stores ``cancelled``; a stream can be followed again from any
sequence number; another key gets 404; the tenant's cap is a 429 with Retry-After; a cancel sent to
another gateway stops the run; a gateway that shuts down stores its runs ``failed``; one killed mid-run
leaves a record that reads ``failed`` once its deadline passed, never ``in_progress`` forever.
The real model's background response (same text as the foreground one) is in test_responses_api.py.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.cluster import KEYS, Cluster
from tests.support.metrics import metric, scrape
from tests.support.procs import Service
from tests.support.waits import eventually

MODEL = "synthetic"
LONG = 1000
"""Output tokens asked for (the synthetic engine stops at 16: 8 s)."""
MAX_S = 5
"""--background-max-s of the second gateway (`short_lived`): a run stops there; an orphaned record
expires at twice it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(shards=1, caches=2, token_delay_ms=500,
                 gateway_args=["--background-per-tenant", "2"]) as c:
        yield c


def short_lived(c: Cluster, max_s: float = MAX_S) -> Service:
    """Another gateway of the cluster whose background responses may run `max_s` seconds (not started)."""
    return Service(["gateway", "--registry-url", c.registry, "--tokenizer", "whitespace", "--model-name", MODEL,
                    "--background-max-s", str(max_s)], env=c.gateway.env)


def sdk(c: Cluster, key: str = "plus") -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=60)


def status(c: Cluster, rid: str, key: str = "plus") -> str:
    return sdk(c, key).responses.retrieve(rid).status


def active(c: Cluster) -> float:
    return metric(c.gateway.url, "switchboard_background_responses_active")


def shard_running(c: Cluster) -> float:
    """Sequences the shard is generating (its engine's gauge): 0 once a cancelled run's work is aborted."""
    return metric(c.shards[0].url, "vllm:num_requests_running")


def test_background_create_poll_complete_and_tenant_binding(cluster: Cluster) -> None:
    client = sdk(cluster)
    t0 = time.monotonic()
    r = client.responses.create(model=MODEL, input="say something", background=True, max_output_tokens=6)
    took = time.monotonic() - t0
    assert r.background is True and r.status == "queued" and r.id.startswith("resp_"), r
    assert took < 5, f"create waited {took:.1f} s: it should return before the generation"
    eventually(lambda: status(cluster, r.id) == "incomplete", 40, what="the background response done")
    done = client.responses.retrieve(r.id)
    assert done.background is True and done.output_text and done.usage.output_tokens == 6
    assert done.incomplete_details is not None and done.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in client.responses.input_items.list(r.id).data] == ["message"]
    # a chain continues from it as from any response
    nxt = client.responses.create(model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=4)
    assert nxt.status in ("completed", "incomplete") and nxt.usage.input_tokens > done.usage.input_tokens
    # another key (same tenant, even) sees nothing, nor can it cancel or follow it
    other = sdk(cluster, "plus2")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id, stream=True, starting_after=0)
    # finished: cancel is OpenAI's 400; a response that was not background cannot be cancelled either
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(r.id)
    assert e.value.body["message"] == "Cannot cancel an incomplete response."  # was "a incomplete"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(nxt.id)
    assert "background" in e.value.body["message"]


def test_background_needs_store_and_checks_come_first(cluster: Cluster) -> None:
    client = sdk(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert e.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as e:  # the request's own error, answered at once
        client.responses.create(model=MODEL, input="x", background=True, previous_response_id="resp_nope")
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True, max_output_tokens=10**9)


def test_cancel_aborts_the_shard_work(cluster: Cluster) -> None:
    client = sdk(cluster)
    r = client.responses.create(model=MODEL, input="tell a long story", background=True, max_output_tokens=LONG)
    eventually(lambda: shard_running(cluster) >= 1, 20, what="the run generating on the shard")
    eventually(lambda: client.responses.retrieve(r.id).status == "in_progress", 20, what="in_progress")
    time.sleep(0.5)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id, cancelled
    assert cancelled.output_text, "the output so far is kept"
    eventually(lambda: shard_running(cluster) == 0, 10, what="the shard's work aborted")
    got = client.responses.retrieve(r.id)
    assert got.status == "cancelled" and got.usage is not None and 0 < got.usage.output_tokens < LONG
    assert client.responses.cancel(r.id).status == "cancelled"  # idempotent
    eventually(lambda: active(cluster) == 0, 10, what="no background response active")


def test_deleting_a_running_response_stops_it(cluster: Cluster) -> None:
    client = sdk(cluster)
    r = client.responses.create(model=MODEL, input="tell a long story", background=True, max_output_tokens=LONG)
    eventually(lambda: client.responses.retrieve(r.id).status == "in_progress", 20, what="in_progress")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    eventually(lambda: shard_running(cluster) == 0, 10, what="the shard's work aborted (no one can read it)")
    eventually(lambda: active(cluster) == 0, 10, what="the run ended")
    with pytest.raises(openai.NotFoundError):  # its end was not written back over the tombstone
        client.responses.retrieve(r.id)


def test_stream_then_resume_after_a_sequence_number(cluster: Cluster) -> None:
    client = sdk(cluster)
    first: list = []
    with client.responses.create(model=MODEL, input="count", background=True, stream=True,
                                 max_output_tokens=12) as stream:
        for event in stream:
            first.append(event)
            if len(first) == 6:
                break  # the client goes away mid-stream: the run goes on
    rid = first[0].response.id
    assert first[0].type == "response.created" and first[0].response.background is True
    eventually(lambda: status(cluster, rid) == "incomplete", 40, what="done without its client")
    after = first[-1].sequence_number
    with client.responses.retrieve(rid, stream=True, starting_after=after) as resumed:
        rest = list(resumed)
    assert [e.sequence_number for e in rest] == list(range(after + 1, after + 1 + len(rest)))
    assert rest[-1].type == "response.incomplete"  # max_output_tokens reached
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == client.responses.retrieve(rid).output_text
    # from the start, the same events again
    with client.responses.retrieve(rid, stream=True) as again:
        assert [e.sequence_number for e in again][-1] == rest[-1].sequence_number


def test_tenant_cap_is_a_429_with_retry_after(cluster: Cluster) -> None:
    client = sdk(cluster)
    ids = [client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG).id
           for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as e:
        sdk(cluster, "plus2").responses.create(model=MODEL, input="x", background=True)  # same tenant, acme
    assert int(e.value.response.headers["retry-after"]) >= 1 and e.value.body["param"] == "background"
    # another tenant is not held back
    other = sdk(cluster, "enterprise").responses.create(model=MODEL, input="x", background=True, max_output_tokens=2)
    assert other.status == "queued"
    for rid in ids:
        assert client.responses.cancel(rid).status == "cancelled"
    again = client.responses.create(model=MODEL, input="x", background=True, max_output_tokens=2)
    eventually(lambda: status(cluster, again.id) == "incomplete", 30, what="a slot again once cancelled")


def test_streams_following_one_run_are_bounded(cluster: Cluster) -> None:
    """Unbounded, one key held 300 streams on one run (GETs: no rate limit or admission meters them), so
    a tenant's few runs could take every connection of the gateway for --background-max-s; and a stream
    whose client left held its place until the run ended."""
    from data_plane.gateway.responses_detached import MAX_FOLLOWERS

    rid = sdk(cluster).responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG).id
    url, auth = f"{cluster.gateway.url}/v1/responses/{rid}", {"Authorization": f"Bearer {KEYS['plus']}"}
    with httpx.Client(timeout=30) as http:
        held = [http.send(http.build_request("GET", url, params={"stream": "true"}, headers=auth), stream=True)
                for _ in range(MAX_FOLLOWERS)]
        try:
            assert [r.status_code for r in held] == [200] * MAX_FOLLOWERS
            over = http.get(url, params={"stream": "true"}, headers=auth)
            assert over.status_code == 429 and over.json()["error"]["param"] == "stream", over.text
            assert int(over.headers["retry-after"]) >= 1
            assert http.get(url, headers=auth).status_code == 200  # polling is not a stream
            held.pop().close()  # a stream that ends gives its place back (once the gateway sees it leave)

            def another() -> bool:
                r = http.send(http.build_request("GET", url, params={"stream": "true"}, headers=auth), stream=True)
                held.append(r)
                return r.status_code == 200

            # at once, not when the run ends (8 s): a follower's disconnect went unnoticed until then (its
            # empty GET body was the message the watch took for the client's)
            eventually(another, 3, interval_s=0.2, what="a place once a stream closed")
        finally:
            for r in held:
                r.close()
    with contextlib.suppress(openai.BadRequestError):  # not to hold the tenant's cap for the next test
        sdk(cluster).responses.cancel(rid)


def test_a_run_past_its_limit_fails_and_a_killed_gateway_leaves_no_run_in_progress(cluster: Cluster) -> None:
    gw = short_lived(cluster).start()
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=60)
        eventually(lambda: client.models.list().data, 30, what="the second gateway sees the shard")
        r = client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG)
        eventually(lambda: client.responses.retrieve(r.id).status == "failed", MAX_S + 15,
                   what="stopped at --background-max-s")
        err = client.responses.retrieve(r.id).error
        assert err is not None and err.code == "server_error" and "limit" in err.message
        # counted as the limit that stopped it (it was 499 client_disconnected: the run's stop read as its
        # absent client leaving), what it produced billed as a stream cut at a limit is
        eventually(lambda: metric(gw.url, "switchboard_gateway_requests_total", code="request_timeout") == 1, 10,
                   what="counted as request_timeout")
        assert metric(gw.url, "switchboard_gateway_requests_total", code="client_disconnected") == 0
        # a cancel sent to another gateway (this one; the first runs it): the record says so, and the
        # running gateway stops the run and stores the output it had
        runner = sdk(cluster)
        before = metric(cluster.gateway.url, "switchboard_background_responses_total", outcome="cancelled")
        r = runner.responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG)
        eventually(lambda: runner.responses.retrieve(r.id).status == "in_progress", 20, what="in progress")
        assert client.responses.cancel(r.id).status == "cancelled"
        eventually(lambda: metric(cluster.gateway.url, "switchboard_background_responses_total",
                                  outcome="cancelled") == before + 1, 10, what="the running gateway stopped it")
        eventually(lambda: client.responses.retrieve(r.id).output_text != "", 10, what="its output so far stored")
        assert client.responses.retrieve(r.id).status == "cancelled"
        eventually(lambda: shard_running(cluster) == 0, 10, what="the shard's work aborted")
        # kill -9 the gateway mid-run: nothing can store its end; another gateway reports it failed at the deadline
        r = client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG)
        eventually(lambda: client.responses.retrieve(r.id).status == "in_progress", 20, what="in progress")
        killed_at = time.monotonic()
        gw.kill()
    finally:
        gw.stop()
    seen = status(cluster, r.id)  # the first gateway reads the record the dead one left
    assert seen in ("queued", "in_progress"), seen  # its gateway may be alive, for all this one knows
    eventually(lambda: status(cluster, r.id) == "failed", 2 * MAX_S + 10, what="expired at its deadline")
    assert time.monotonic() - killed_at <= 2 * MAX_S + 10
    got = sdk(cluster).responses.retrieve(r.id)
    assert got.error is not None and "stopped before it finished" in got.error.message
    with pytest.raises(openai.BadRequestError):
        sdk(cluster).responses.cancel(r.id)


def test_a_gateway_that_shuts_down_stores_its_runs_failed(cluster: Cluster) -> None:
    gw = short_lived(cluster, max_s=600).start()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=60)
    try:
        eventually(lambda: client.models.list().data, 30, what="the second gateway sees the shard")
        r = client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG)
        eventually(lambda: client.responses.retrieve(r.id).status == "in_progress", 20, what="in progress")
    finally:
        gw.stop()  # SIGTERM: the graceful shutdown
    got = sdk(cluster).responses.retrieve(r.id)  # at once, from the other gateway: no deadline to wait for
    assert got.status == "failed" and got.error is not None and "shut down" in got.error.message, got
    assert got.output_text, "the output it had is kept"


def test_a_run_its_gateways_shutdown_stops_is_billed_as_the_shutdown_not_a_client_disconnect(
        cluster: Cluster, tmp_path: Path) -> None:
    """The run above, stopped by its gateway's SIGTERM (a restart of `switchboard up`, a deploy): the response
    said so ("the gateway shut down"), but the usage ledger, the request metrics and the log had it as the
    client's doing (499 ``client_disconnected``, "client disconnected; generation aborted"): the run reads its
    stop as a disconnect of its (absent) client. It is ``server_shutting_down`` now, what it produced billed as
    a stream the shutdown cut is (200: its create was answered, its record keeps the output)."""
    db = tmp_path / "usage.db"
    gw = Service(["gateway", "--registry-url", cluster.registry, "--tokenizer", "whitespace", "--model-name", MODEL,
                  "--usage-db", f"sqlite:///{db}", "--state-dir", str(tmp_path)], env=cluster.gateway.env).start()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=60)
    try:
        eventually(lambda: client.models.list().data, 30, what="the gateway sees the shard")
        r = client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=LONG)
        eventually(lambda: client.responses.retrieve(r.id).status == "in_progress", 20, what="in progress")
    finally:
        gw.stop()  # SIGTERM
    got = sdk(cluster).responses.retrieve(r.id)
    assert got.status == "failed", got
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT status, error_code, completion_tokens FROM usage_records").fetchall()
    stored = sdk(cluster).responses.retrieve(r.id).usage
    assert stored is not None and rows == [(200, "server_shutting_down", stored.output_tokens)], (rows, stored)
    log = gw.log_tail(50_000)
    assert "client disconnected" not in log and "server shutting down; generation aborted" in log, log


def test_metrics_and_log_have_no_prompt(cluster: Cluster) -> None:
    secret = "zebra-umbrella-47"
    r = sdk(cluster).responses.create(model=MODEL, input=secret, background=True, max_output_tokens=3)
    eventually(lambda: status(cluster, r.id) == "incomplete", 30, what="done")
    eventually(lambda: metric(cluster.gateway.url, "switchboard_background_responses_total", outcome="incomplete") >= 1,
               10, what="counted")
    log = cluster.gateway.log_tail(200_000)
    assert f"background response {r.id} ended incomplete" in log and secret not in log
    raw = scrape(cluster.gateway.url)
    assert "switchboard_background_event_bytes" in raw and json.dumps(secret) not in raw


def test_a_run_cancelled_while_streamed_ends_its_streams_with_a_terminal_event(cluster: Cluster) -> None:
    """A background response cancelled while a client streamed it (its create's stream, or `retrieve(stream=True)`)
    ended the stream right after its last delta, with no terminal event: the SDK's `responses.stream` and the
    Agents SDK wait for completed, failed or incomplete. Each stream now ends with ``response.failed`` carrying the
    response as stored, status ``cancelled`` (the Responses stream has no cancelled event), then closes."""
    client = sdk(cluster)
    events: list = []
    followed: list = []

    def follow(rid: str) -> None:
        with sdk(cluster).responses.retrieve(rid, stream=True) as again:
            followed.extend(again)

    follower = None
    with client.responses.create(model=MODEL, input="tell a long story", background=True, stream=True,
                                 max_output_tokens=LONG) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and follower is None:
                rid = events[0].response.id
                follower = threading.Thread(target=follow, args=(rid,))
                follower.start()
                time.sleep(0.3)
                assert client.responses.cancel(rid).status == "cancelled"
    assert follower is not None
    follower.join(30)
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "cancelled", [e.type for e in events[-3:]]
    assert last.response.error is None and last.response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert followed and followed[-1].type == "response.failed" and followed[-1].sequence_number == last.sequence_number
    assert client.responses.retrieve(rid).model_dump() == last.response.model_dump()


def test_a_stream_that_outlives_its_in_progress_deadline_stays_in_progress_and_a_dead_ones_expires(
        cluster: Cluster) -> None:
    """A stored foreground stream is ``in_progress`` with a deadline past which a reader calls it failed (its gateway
    died). One still streaming past it was stored failed by the next reader (retrieve said failed mid-stream, a 500
    counted): its gateway now moves the deadline on while it streams. And the deadline's grace was a fixed 60 s past
    --background-max-s (a background record's is at most --background-max-s): a dead gateway's stream now expires
    as its background runs do."""
    max_s = 2  # its record's deadline: 4 s ahead; the synthetic reply takes 8 s
    gw = short_lived(cluster, max_s=max_s).start()
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=60)
        eventually(lambda: client.models.list().data, 30, what="the second gateway sees the shard")
        types: list[str] = []
        mid_stream = None
        with client.responses.create(model=MODEL, input="long", stream=True, max_output_tokens=LONG) as stream:
            for event in stream:
                types.append(event.type)
                if event.type == "response.created":
                    rid, started = event.response.id, time.monotonic()
                elif mid_stream is None and time.monotonic() - started > 2 * max_s + 1.5:
                    mid_stream = status(cluster, rid)  # the other gateway (no run of it there), past the first deadline
        assert mid_stream == "in_progress", mid_stream
        assert types[-1] == "response.completed", types[-3:]
        got = sdk(cluster).responses.retrieve(rid)
        assert got.status == "completed" and got.error is None and got.output_text, got
        # kill -9 the gateway mid-stream: its record reads failed once the deadline passed, not a minute later
        with contextlib.suppress(openai.APIError, httpx.HTTPError), \
                client.responses.create(model=MODEL, input="long", stream=True, max_output_tokens=LONG) as stream:
            for event in stream:
                if event.type == "response.created":
                    rid = event.response.id
                    killed_at = time.monotonic()
                    gw.kill()
    finally:
        gw.stop()
    eventually(lambda: status(cluster, rid) == "failed", 2 * max_s + 10, what="expired at its deadline")
    assert time.monotonic() - killed_at <= 2 * max_s + 10


def test_a_previous_response_still_running_is_a_400_not_a_chain_without_its_reply(cluster: Cluster) -> None:
    """A `previous_response_id` naming a response still queued or in progress (a background run, a stored stream)
    went on from its input alone, silently leaving out the reply it had not finished: now OpenAI's 400 on that
    parameter, saying to wait for it; once it completed, the same request chains from it."""
    client = sdk(cluster)
    running = client.responses.create(model=MODEL, input="long", background=True, max_output_tokens=6)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="and then?", previous_response_id=running.id, max_output_tokens=2)
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "previous_response_id", body
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_value", body
    assert "is still queued" in body["message"] or "is still in progress" in body["message"], body
    # a stored stream is in_progress from its response.created on
    with client.responses.create(model=MODEL, input="long", stream=True, max_output_tokens=4) as stream:
        for event in stream:
            if event.type == "response.created":
                with pytest.raises(openai.BadRequestError) as refused:
                    client.responses.create(model=MODEL, input="and then?", previous_response_id=event.response.id,
                                            max_output_tokens=2)
                assert "is still in progress" in str(refused.value), refused.value
    eventually(lambda: status(cluster, running.id) == "incomplete", 40, what="the background response done")
    nxt = client.responses.create(model=MODEL, input="and then?", previous_response_id=running.id, max_output_tokens=2)
    assert nxt.status in ("completed", "incomplete")
