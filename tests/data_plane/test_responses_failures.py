"""Responses that end without their reply, and the errors around them, with real processes: a
control plane, one synthetic shard (killed mid-stream: no shard left to resume on), two cache nodes
and a gateway, driven by the openai SDK.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_responses_failures.py -q

A stream that fails after ``response.created`` is stored as ``failed`` (its error, the output the
client got), one the client leaves as ``incomplete`` (reason ``client_disconnected``), both under the
id the stream gave; `previous_response_id` on a failed one continues from its input. Oversized
instructions are named as such; the Conversations routes' errors carry the request and trace ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.cluster import KEYS, Cluster
from tests.support.waits import eventually

MODEL = "synthetic"
STORY = "tell me a long story about a lighthouse keeper"
LONG = 1000
"""Output tokens asked for: 40 s at 40 ms a token, so a stream is still going when a loaded test acts on it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(shards=1, caches=2, token_delay_ms=40) as c:
        yield c


def sdk(c: Cluster, key: str = "plus") -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=120)


def post(c: Cluster, path: str, body: dict, key: str = "plus") -> httpx.Response:
    return httpx.post(c.gateway.url + path, json=body, timeout=60, headers={"Authorization": f"Bearer {KEYS[key]}"})


def assert_ids(r: httpx.Response) -> dict:
    """An OpenAI error that names its request and trace (body and headers), as the chat path's do."""
    err = r.json()["error"]
    assert len(err.get("request_id") or "") == 32 and len(err.get("trace_id") or "") == 32, err
    assert r.headers["x-request-id"] == err["request_id"] and r.headers["x-trace-id"] == err["trace_id"]
    return err


def test_conversation_and_stored_response_errors_carry_request_and_trace_ids(cluster: Cluster) -> None:
    url, auth = cluster.gateway.url, {"Authorization": f"Bearer {KEYS['plus']}"}
    missing = httpx.get(url + "/v1/conversations/conv_nope", headers=auth, timeout=30)
    assert missing.status_code == 404 and assert_ids(missing)["param"] == "conversation_id"
    bad = httpx.post(url + "/v1/conversations", content=b"[1,", timeout=30,
                     headers={**auth, "content-type": "application/json"})
    assert bad.status_code == 400 and assert_ids(bad)
    unauthenticated = httpx.get(url + "/v1/conversations/conv_nope", timeout=30,
                                headers={"Authorization": "Bearer sk-nobody"})
    assert unauthenticated.status_code == 401 and assert_ids(unauthenticated)
    gone = httpx.get(url + "/v1/responses/resp_nope", headers=auth, timeout=30)
    assert gone.status_code == 404 and assert_ids(gone)["param"] == "response_id"
    a, b = assert_ids(missing), assert_ids(gone)
    assert a["request_id"] != b["request_id"] and a["trace_id"] != b["trace_id"]


def test_instructions_too_long_for_the_context_are_named(cluster: Cluster) -> None:
    huge = "word " * 9000  # the plus tier's 8192-token context, whatever the input
    for truncation in ("disabled", "auto"):
        r = post(cluster, "/v1/responses", {"model": MODEL, "input": "hi", "instructions": huge,
                                            "truncation": truncation, "max_output_tokens": 8})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "instructions", err
        assert "instructions" in err["message"]
    # the input is still what is named when the instructions fit and the input does not
    r = post(cluster, "/v1/responses", {"model": MODEL, "input": huge, "instructions": "Be brief.",
                                        "max_output_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_stream_the_client_leaves_is_stored_incomplete(cluster: Cluster) -> None:
    got: list[str] = []
    response_id = ""
    with httpx.stream("POST", cluster.gateway.url + "/v1/responses", timeout=60,
                      headers={"Authorization": f"Bearer {KEYS['plus']}"},
                      json={"model": MODEL, "input": STORY, "stream": True, "max_output_tokens": LONG}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.created":
                response_id = event["response"]["id"]
            elif event["type"] == "response.output_text.delta":
                got.append(event["delta"])
                if len(got) >= 3:
                    break  # the connection closes here, mid-reply
    client = sdk(cluster)

    def stored() -> bool:
        try:
            return client.responses.retrieve(response_id).status == "incomplete"
        except openai.NotFoundError:
            return False

    eventually(stored, 30, what="the abandoned response stored")
    resp = client.responses.retrieve(response_id)
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "client_disconnected"
    assert resp.error is None and resp.output_text.startswith("".join(got)) and resp.output_text
    assert resp.output[0].status == "incomplete"
    assert resp.usage is not None and 0 < resp.usage.output_tokens < LONG  # aborted: not generated to the end
    with pytest.raises(openai.NotFoundError):
        sdk(cluster, "plus2").responses.retrieve(response_id)


def test_stream_failed_mid_reply_is_stored_failed_and_continues_from_its_input(cluster: Cluster) -> None:
    client = sdk(cluster)
    events = []
    with client.responses.stream(model=MODEL, input=STORY, max_output_tokens=LONG) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and sum(
                    e.type == "response.output_text.delta" for e in events) == 3:
                cluster.shards[0].kill()  # the only shard: no resume is possible
    created, last = events[0], events[-1]
    assert created.type == "response.created" and last.type == "response.failed", [e.type for e in events[-3:]]
    assert any(e.type == "error" for e in events)
    failed = last.response
    assert failed.id == created.response.id and failed.status == "failed"
    assert failed.error is not None and failed.error.code == "server_error" and failed.error.message
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and failed.output_text == streamed
    # stored as the stream told it: same id, status, error and output; this key's only
    got = client.responses.retrieve(failed.id)
    assert got.model_dump() == failed.model_dump()
    assert isinstance(got.error, openai.types.responses.ResponseError)
    with pytest.raises(openai.NotFoundError):
        sdk(cluster, "plus2").responses.retrieve(failed.id)
    items = client.responses.input_items.list(failed.id)
    assert [i.content[0].text for i in items.data] == [STORY]  # type: ignore[union-attr,index]
    # a shard again; the failed response's chain continues from its input (its unfinished output left out)
    cluster.shards[0].start()
    cluster.wait_members(1, len(cluster.caches), timeout=60)
    after = client.responses.create(model=MODEL, input="go on", previous_response_id=failed.id, max_output_tokens=4)
    assert after.error is None and after.previous_response_id == failed.id
    same = client.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"role": "user", "content": STORY}, {"role": "user", "content": "go on"}])
    assert after.usage is not None and same.usage is not None
    assert after.usage.input_tokens == same.usage.input_tokens  # the prompt: its input, then the new one
    # cut short by max_output_tokens: stored incomplete, as OpenAI keeps it
    cut = client.responses.retrieve(after.id)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


def test_a_stored_stream_is_retrievable_in_progress_while_it_streams(cluster: Cluster) -> None:
    """OpenAI keeps a stored response from its ``response.created`` on: `GET /v1/responses/{id}` answers it
    ``in_progress`` while it streams. It was a 404 until the stream ended. It is this key's only, its input
    items list, it is not cancellable (not background), and at the end it reads as the stream's last event;
    `store: false` stays unretrievable, and one deleted while it streams stays deleted."""
    client = sdk(cluster)
    seen: dict[str, object] = {}
    with client.responses.stream(model=MODEL, input=STORY, max_output_tokens=100,  # 4 s
                                 extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
                during = client.responses.retrieve(rid)
                seen["status"], seen["background"] = during.status, during.background
                seen["items"] = [i.content[0].text for i in client.responses.input_items.list(rid).data]  # type: ignore[union-attr,index]
                with pytest.raises(openai.NotFoundError):
                    sdk(cluster, "plus2").responses.retrieve(rid)
                with pytest.raises(openai.BadRequestError):
                    client.responses.cancel(rid)
        final = event.response  # response.incomplete: max_output_tokens reached
    assert seen == {"status": "in_progress", "background": False, "items": [STORY]}, seen
    assert final.id == rid and final.status == "incomplete"
    assert client.responses.retrieve(rid).model_dump() == final.model_dump()
    # store: false is never kept
    with client.responses.stream(model=MODEL, input=STORY, max_output_tokens=4, store=False) as stream:
        for event in stream:
            if event.type == "response.created":
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(event.response.id)
    # deleted while it streams: the stream ends as ever, the delete stands
    with client.responses.stream(model=MODEL, input=STORY, max_output_tokens=50,
                                 extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            if event.type == "response.created":
                client.responses.delete(event.response.id)
        gone = event.response
    assert event.type == "response.incomplete" and gone.status == "incomplete"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
