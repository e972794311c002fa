"""The Responses and Conversations APIs end to end: the real model (the session's fp32 shard), two
cache nodes and a gateway on loopback, driven by the openai SDK and the OpenAI Agents SDK."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from data_plane.cache.model import TOMBSTONE_VERSION
from tests.support.cluster import KEYS, cache_node, stored_session
from tests.support.metrics import metric, scrape
from tests.support.procs import Service
from tests.support.waits import eventually

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The chat template's default system prompt: instructions the 135M model answers well under."""


class Stack:
    def __init__(self, gateway: Service, caches: list[Service], state: Path) -> None:
        self.gateway, self.caches, self.state = gateway, caches, state

    def ledger_rows(self, request_ids: list[str]) -> dict[str, tuple[str, int, int]]:
        """request id -> (shard, prompt_tokens, cached_tokens) once the ledger has written them."""
        deadline = time.monotonic() + 20
        while True:
            with sqlite3.connect(self.state / "usage.db") as db:
                rows = {r[0]: r[1:] for r in db.execute(
                    "SELECT request_id, shard, prompt_tokens, cached_tokens FROM usage_records WHERE request_id IN "
                    f"({','.join('?' * len(request_ids))})", request_ids)}
            if len(rows) == len(request_ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.2)

    def chat(self, body: dict, key: str = "plus", headers: dict | None = None) -> httpx.Response:
        return httpx.post(self.gateway.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS[key]}", **(headers or {})})

    def sdk(self, key: str = "plus") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=120)


def written(stack: Stack, stored_before: float) -> None:
    """Wait for the reply's write to the response cache: it is made off the request path, so on a
    loaded machine an immediate repeat can arrive first (and is then, rightly, a miss)."""
    eventually(lambda: metric(stack.gateway.url, "switchboard_response_cache_stores_total", result="ok")
               > stored_before, 30, what="the reply in the response cache")


def assert_gone(stack: Stack, record_id: str) -> None:
    """Nothing left on any cache node but the record's tombstone (no messages, the highest version:
    no old copy can be written back over it, data_plane/cache/client.py)."""
    left = [stored_session(c.url, record_id) for c in stack.caches]
    assert all(r is None or (r["messages"] == [] and r["version"] == TOMBSTONE_VERSION) for r in left), left
    assert any(r is not None for r in left)


@pytest.fixture(scope="module")
def stack(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("responses-gw")
    caches = [cache_node() for _ in range(2)]
    for c in caches:
        c.start(wait=False)
    for c in caches:
        c.wait_healthy()
    keys = ",".join([f"{KEYS['plus']}:acme:plus", f"{KEYS['plus2']}:acme:plus", f"{KEYS['enterprise']}:bigco:enterprise"])
    gw = Service(["gateway", "--shard-urls", fp32_shard.url, "--cache-urls", ",".join(c.url for c in caches),
                  "--state-dir", str(state), "--usage-db", f"sqlite:///{state}/usage.db", "--response-cache"],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": keys})
    try:
        with gw:
            yield Stack(gw, caches, state)
    finally:
        for c in caches:
            c.stop()


def test_create_chain_retrieve_input_items_delete(stack: Stack) -> None:
    sdk = stack.sdk()
    first = sdk.responses.create(model=MODEL, input="Name the capital of France.", instructions=SYSTEM,
                                 max_output_tokens=12, temperature=0)
    assert first.id.startswith("resp_") and first.object == "response"
    assert "Paris" in first.output_text and first.usage.input_tokens > 0
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    second = sdk.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                  max_output_tokens=12, temperature=0, metadata={"ticket": "T-1"})
    assert second.metadata == {"ticket": "T-1"}
    assert second.previous_response_id == first.id
    # the chain replays token-exactly on the shard holding its KV: the whole first turn is cached
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 8
    got = sdk.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.usage.total_tokens == second.usage.total_tokens
    assert got.metadata == {"ticket": "T-1"} and got.previous_response_id == first.id
    items = sdk.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "And of Italy?"
    # another key (even of the same tenant) sees nothing; continuing its chain is OpenAI's 400 for that
    for call in (lambda s: s.responses.retrieve(first.id), lambda s: s.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call(stack.sdk("plus2"))
        assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as refused:
        stack.sdk("plus2").responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
    # deleted: gone from every cache node, and a 404 after
    held = [c for c in stack.caches if stored_session(c.url, first.id) is not None]
    assert held, "a stored response lives on the cache nodes"
    sdk.responses.delete(first.id)
    assert_gone(stack, first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    # store=false: answered, never kept
    unstored = sdk.responses.create(model=MODEL, input="Say hi.", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


def test_stream_events_in_order_with_sequence_numbers(stack: Stack) -> None:
    sdk = stack.sdk()
    with sdk.responses.stream(model=MODEL, input="Reply with one word: hello.", max_output_tokens=24,
                              temperature=0) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in types
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.usage.output_tokens > 0
    assert sdk.responses.retrieve(final.id).output_text == text


def test_conversations_crud_and_turns(stack: Stack) -> None:
    sdk = stack.sdk()
    conv = sdk.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Zed."}],
                                    metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    r = sdk.responses.create(model=MODEL, input="What is my name?", conversation=conv.id, max_output_tokens=12,
                             temperature=0)
    assert r.conversation.id == conv.id and r.usage.input_tokens > 10
    items = sdk.conversations.items.list(conv.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 3
    assert items.data[0].content[0].text == "My name is Zed." and items.data[2].role == "assistant"
    added = sdk.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Hi"}])
    sdk.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(sdk.conversations.items.list(conv.id).data) == 3
    assert sdk.conversations.update(conv.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    assert sdk.conversations.retrieve(conv.id).metadata == {"topic": "x"}
    with pytest.raises(openai.NotFoundError):
        stack.sdk("plus2").conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        stack.sdk("plus2").responses.create(model=MODEL, input="x", conversation=conv.id, max_output_tokens=2)
    assert sdk.conversations.delete(conv.id).deleted
    assert_gone(stack, conv.id)
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conv.id)


def test_a_conversation_deleted_during_its_turn_is_a_404_and_stays_deleted(stack: Stack) -> None:
    """Regression: a turn whose conversation was deleted while it generated ended on the cache's 409
    ("session 'conv_...' already has a newer version", param `version`, its tombstone's stored_version):
    streamed, the error event and the failed response said so. Now it is OpenAI's 404 for the
    conversation, and nothing brings the conversation back."""
    sdk = stack.sdk()
    conv = sdk.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello."}])
    body = {"model": MODEL, "input": "Tell me a story.", "conversation": conv.id, "max_output_tokens": 48,
            "ignore_eos": True, "stream": True}
    events = []
    deleted = False
    with httpx.stream("POST", stack.gateway.url + "/v1/responses", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['plus']}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta" and not deleted:  # at the first delta
                    deleted = sdk.conversations.delete(conv.id).deleted
    assert deleted
    error, failed = events[-2], events[-1]
    assert error["type"] == "error" and error["code"] == "not_found" and error["param"] == "conversation_id", error
    assert failed["type"] == "response.failed" and "not found" in failed["response"]["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conv.id)


def _locked_or_ok(r: httpx.Response) -> bool:
    """True for a 200; a refusal must be OpenAI's conversation_locked 400, nothing else."""
    if r.status_code == 200:
        return True
    assert r.status_code == 400 and r.json()["error"]["code"] == "conversation_locked", r.text
    return False


def test_concurrent_writes_to_one_conversation_lose_no_turn(stack: Stack) -> None:
    """Regression: 6 responses at once on one conversation all got 200 and 5 of the turns vanished
    (each loaded version v and saved v + 1; the nodes kept the last). Now a second writer is refused
    with OpenAI's 400 conversation_locked, and every turn that got a 200 is stored; concurrent item
    adds wait their turn and all land; an X-Session-Id chat session is guarded the same way."""
    sdk = stack.sdk()
    conv = sdk.conversations.create()
    url, auth = stack.gateway.url + "/v1", {"Authorization": f"Bearer {KEYS['plus']}"}

    def turn(i: int) -> bool:
        return _locked_or_ok(httpx.post(url + "/responses", headers=auth, timeout=120, json={
            "model": MODEL, "input": f"Say the number {i}.", "conversation": conv.id, "max_output_tokens": 8}))

    with ThreadPoolExecutor(6) as pool:
        answered = sum(pool.map(turn, range(6)))
    assert answered >= 1
    assert len(sdk.conversations.items.list(conv.id, limit=100).data) == 2 * answered

    conv2 = sdk.conversations.create()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: sdk.conversations.items.create(
            conv2.id, items=[{"type": "message", "role": "user", "content": f"note {i}"}]), range(8)))
    texts = sorted(i.content[0].text for i in sdk.conversations.items.list(conv2.id, limit=100).data)
    assert texts == [f"note {i}" for i in range(8)]

    first = stack.chat({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                       headers={"X-Session-Id": "new"})
    sid = first.headers["x-session-id"]
    with ThreadPoolExecutor(4) as pool:
        answered = sum(pool.map(lambda i: _locked_or_ok(stack.chat(
            {"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 8},
            headers={"X-Session-Id": sid})), range(4)))
    held = [stored_session(c.url, sid) for c in stack.caches]
    assert max(len(r["messages"]) for r in held if r) == 2 + 2 * answered


def test_a_turn_sent_the_moment_the_last_one_completes_is_not_refused(stack: Stack) -> None:
    """An app (or the Agents SDK) that sends its next turn as soon as it reads `response.completed`, or
    a chat session's `finish_reason`, while the last stream is still open, is answered, never told
    conversation_locked: no turn's lock outlives its save. (The lock is let go at the save, before the
    reply's last bytes; that ordering is too fast to observe from a client here, so this guards the
    outcome, and tests/data_plane/test_record_locks.py pins who waits and who is refused.)"""
    sdk = stack.sdk()
    conv = sdk.conversations.create()
    url, auth = stack.gateway.url + "/v1", {"Authorization": f"Bearer {KEYS['plus']}"}
    ask = {"model": MODEL, "conversation": conv.id, "max_output_tokens": 6, "stream": True}
    for i in range(4):
        with httpx.stream("POST", url + "/responses", headers=auth, timeout=120,
                          json={**ask, "input": f"Say the number {i}."}) as first:
            for line in first.iter_lines():
                if line.startswith("data:") and json.loads(line[5:]).get("type") in (
                        "response.completed", "response.incomplete"):
                    # the stream is still open: its handler has not returned yet
                    nxt = httpx.post(url + "/responses", headers=auth, timeout=120,
                                     json={**ask, "stream": False, "input": "And the next?"})
                    assert nxt.status_code == 200, nxt.text
                    break
    assert len(sdk.conversations.items.list(conv.id, limit=100).data) == 4 * 4
    sid = "new"
    for _ in range(3):
        with httpx.stream("POST", url + "/chat/completions", headers={**auth, "X-Session-Id": sid}, timeout=120,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                "stream": True}) as first:
            sid = first.headers["x-session-id"]
            for line in first.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]" and any(
                        c.get("finish_reason") for c in json.loads(line[5:]).get("choices", [])):
                    nxt = stack.chat({"messages": [{"role": "user", "content": "More."}], "max_tokens": 4},
                                     headers={"X-Session-Id": sid})
                    assert nxt.status_code == 200, nxt.text
                    break


@pytest.mark.parametrize("body,status,param", [
    ({"input": "x", "background": True, "store": False}, 400, "store"),
    ({"input": "x", "bogus": 1}, 400, "bogus"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ({"input": "x", "conversation": "conv_nope"}, 404, "conversation_id"),
    ({"input": "x", "previous_response_id": "resp_a", "conversation": "conv_b"}, 400, None),  # OpenAI: mutually_exclusive_parameters, param null
    ({"input": "word " * 3000, "max_output_tokens": 4}, 400, "input"),
    # the chat path's checks name the Responses body's fields (they named max_tokens, messages)
    ({"input": "word " * 3000, "max_output_tokens": 4, "truncation": "auto"}, 400, "input"),
    ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 4, "tools": [{"type": "function", "name": f"f{i}", "description": "word " * 400,
                                                       "parameters": {"type": "object"}} for i in range(8)]},
     400, "tools"),
    ({"input": ""}, 400, "input"),
    # strict types (lax mode took "no" as false) and OpenAI's bounds and required fields
    ({"input": "x", "stream": "no"}, 400, "stream"),
    ({"input": "x", "store": "no"}, 400, "store"),
    ({"input": "x", "max_output_tokens": "8"}, 400, "max_output_tokens"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                        "strict": "yes"}}}, 400, "text.format.strict"),
    ({"input": "x", "text": {"format": "json"}}, 400, "text.format"),  # was a 500
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "input"),
    # a Responses function tool is flat: the param named the chat path's `tools.0.function.name` (OpenAI: tools[0].name)
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
    # a schema the shard's grammar refuses: it named the chat path's `response_format`
    ({"input": "x", "max_output_tokens": 4, "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "["}}}}}}, 400, "text.format"),
    # a tool result's image part was dropped without a word (the model saw an empty result)
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[1].output[0]"),
    ({"input": [{"role": "user", "content": "a", "id": "msg_1"}, {"role": "user", "content": "b", "id": "msg_1"}]},
     400, "input"),
    ({"input": "x", "service_tier": "fastest"}, 400, "service_tier"),
    # unknown fields of `text` were dropped without a word, as the body's own are not
    ({"input": "x", "text": {"formats": {"type": "json_object"}}}, 400, "text.formats"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                        "schemas": {}}}}, 400, "text.format.schemas"),
])
def test_bad_requests_are_openai_errors(stack: Stack, body: dict, status: int, param: str | None) -> None:
    r = httpx.post(stack.gateway.url + "/v1/responses", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {KEYS['plus']}"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert "tool_call_id" not in err["message"]  # the Responses API's words, not the chat path's


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_conversation_or_previous_response_id_is_a_400_not_a_turn_without_history(
        stack: Stack, stream: bool) -> None:
    """`conversation: ""` and `previous_response_id: ""` (an app's unset id) were taken for "none": a 200
    whose model saw none of the history, and nothing stored in any conversation. OpenAI's 400 empty_string,
    before the stream's first byte; for input_tokens.count too."""
    client = stack.sdk()
    for field, value, param in (("conversation", "", "conversation"), ("previous_response_id", "", "previous_response_id"),
                                ("conversation", {"id": ""}, "conversation")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4, stream=stream,
                                    **{field: value})
        assert bad.value.body["param"] == param, bad.value.body
        assert bad.value.body["code"] == ("invalid_value" if isinstance(value, dict) else "empty_string")
        with pytest.raises(openai.BadRequestError):
            client.responses.input_tokens.count(model=MODEL, input="x", **{field: value})


def test_conversation_with_previous_response_id_is_openais_mutually_exclusive_error(stack: Stack) -> None:
    """It was a 400 invalid_value naming previous_response_id in words of our own; a client that reads
    OpenAI's code (mutually_exclusive_parameters, param null) did not recognise it."""
    client = stack.sdk()
    prev = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    conv = client.conversations.create()
    for call in (client.responses.create, client.responses.input_tokens.count):
        with pytest.raises(openai.BadRequestError) as bad:
            call(model=MODEL, input="x", previous_response_id=prev.id, conversation=conv.id)
        assert bad.value.body == {"message": "Mutually exclusive parameters. Ensure you are only providing one of: "
                                  "'previous_response_id' or 'conversation'.", "type": "invalid_request_error",
                                  "param": None, "code": "mutually_exclusive_parameters",
                                  **{k: bad.value.body[k] for k in ("request_id", "trace_id")}}


def test_conversations_and_compact_refuse_bad_bodies_with_openai_errors(stack: Stack) -> None:
    """Regression: these routes read raw JSON themselves; `items: "x"` made an empty conversation,
    21 items went in at once, a non-string item id was stored, and deep nesting, a lone surrogate or
    `input: 5` were 500s; a text/plain body was taken as JSON; compact took previous_response_id "" for
    none (a 200 compacting the input alone, where create answers 400)."""
    url, auth = stack.gateway.url + "/v1", {"Authorization": f"Bearer {KEYS['plus']}"}
    json_h = {**auth, "content-type": "application/json"}
    item = {"type": "message", "role": "user", "content": "x"}
    for path, body, status, param in [
        ("/conversations", {"items": "x"}, 400, "items"),
        ("/conversations", {"items": [item] * 21}, 400, "items"),
        ("/conversations", {"items": [{**item, "id": 5}]}, 400, "items[0].id"),
        ("/conversations", b'{"items":' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None),
        ("/conversations", b'{"items":[{"role":"user","content":"\\ud800"}]}', 400, None),
        ("/conversations", {"items": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400,
         "items[0].content[0].text"),
        ("/responses", b'{"input":"x","instructions":"\\ud800"}', 400, None),
        ("/responses/compact", {"input": 5}, 400, "input"),
        ("/responses/compact", {"input": "x", "keep_tokens": True}, 400, "keep_tokens"),
        ("/responses/compact", {"input": "x", "previous_response_id": ""}, 400, "previous_response_id"),
        ("/responses/compact", {"input": "x", "previous_response_id": 5}, 400, "previous_response_id"),
    ]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url + path, content=raw, headers=json_h, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text[:300])
    r = httpx.post(url + "/conversations", content=b"{}", headers={**auth, "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text


def test_item_ids_are_unique_in_a_conversation_and_a_chain(stack: Stack) -> None:
    """Regression: an item id given twice was stored twice (OpenAI refuses it: "Duplicate item found with
    id ..."), and a conversation holding it paged forever: `after` found its first copy, so the SDK's
    auto-pagination at limit=1 went A, B, A, B... Now a repeated id is a 400 naming the field, wherever
    the earlier copy is: the same request, the conversation, or the previous response's chain."""
    sdk = stack.sdk()
    a, b = ({"type": "message", "role": "user", "content": t, "id": f"msg_{t}"} for t in ("a", "b"))
    conv = sdk.conversations.create(items=[a, b])
    for call, param in ((lambda: sdk.conversations.create(items=[a, b, a]), "items"),
                        (lambda: sdk.conversations.items.create(conv.id, items=[b]), "items"),
                        (lambda: sdk.responses.create(model=MODEL, input=[a], conversation=conv.id,
                                                      max_output_tokens=2), "input")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param and "Duplicate item found with id msg_" in e.value.body["message"]
    listed = [i.id for i in sdk.conversations.items.list(conv.id, limit=1, order="asc")]  # every page, once
    assert listed == ["msg_a", "msg_b"]
    first = sdk.responses.create(model=MODEL, input=[a], max_output_tokens=2)
    again = first.output[0].model_dump(exclude_none=True)  # the previous output, resent with its chain
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input=[again], previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "input"
    # a query parameter's error names it as the client spelt it (it was `query.limit`)
    r = httpx.get(f"{stack.gateway.url}/v1/conversations/{conv.id}/items?limit=x", timeout=30,
                  headers={"Authorization": f"Bearer {KEYS['plus']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_the_response_echoes_its_settings_and_when_it_completed(stack: Stack) -> None:
    """OpenAI's Response carries the request's prompt_cache_key, safety_identifier and max_tool_calls,
    the service_tier it ran at, and `completed_at` once completed: they were missing (the SDK read None)."""
    sdk = stack.sdk()
    r = sdk.responses.create(model=MODEL, input="Name the capital of France.", instructions=SYSTEM,
                             max_output_tokens=12, temperature=0, prompt_cache_key="geo", safety_identifier="user-7",
                             service_tier="auto")
    assert r.status == "completed" and r.completed_at is not None and r.completed_at >= r.created_at
    assert (r.prompt_cache_key, r.safety_identifier, r.service_tier) == ("geo", "user-7", "default")
    got = sdk.responses.retrieve(r.id)
    assert (got.completed_at, got.prompt_cache_key, got.safety_identifier) == (r.completed_at, "geo", "user-7")
    cut = sdk.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.completed_at is None


def test_agents_sdk_default_responses_model(stack: Stack) -> None:
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = Agent(name="geo", instructions=SYSTEM, model=model,
                  model_settings=ModelSettings(max_tokens=48, temperature=0))

    async def run() -> str:
        result = await Runner.run(agent, "Name the capital of France.")
        return str(result.final_output)

    assert "Paris" in asyncio.run(run())


def test_responses_record_is_not_a_chat_session(stack: Stack) -> None:
    sdk = stack.sdk()
    r = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    out = httpx.post(stack.gateway.url + "/v1/chat/completions", json=body, timeout=60,
                     headers={"Authorization": f"Bearer {KEYS['plus']}", "X-Session-Id": r.id})
    assert out.status_code == 404 and json.loads(out.text)["error"]["code"] == "session_not_found"


def test_response_cache_answers_one_tenant_never_another(stack: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6, "temperature": 0}
    first = stack.chat(body)
    again = stack.chat(body)
    assert first.headers["x-cache"] == "MISS" and again.headers["x-cache"] == "HIT"
    hit = again.json()
    assert hit["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == hit["usage"]["prompt_tokens"]
    # a repeat right after the first is answered from the gateway's own copy (no cache-node round trip)
    assert stack.chat(body).headers["x-cache"] == "HIT"
    # another key of the same tenant shares it; another tenant never does
    assert stack.chat(body, key="plus2").headers["x-cache"] == "HIT"
    assert stack.chat(body, key="enterprise").headers["x-cache"] == "MISS"
    # streamed hit: the same text as SSE
    streamed = stack.chat({**body, "stream": True})
    assert streamed.headers["x-cache"] == "HIT"
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == hit["choices"][0]["message"]["content"]
    # opt-outs (LiteLLM's): no-cache skips the lookup; sampling without a seed is never cached
    assert stack.chat(body, headers={"Cache-Control": "no-cache"}).headers["x-cache"] == "BYPASS"
    assert stack.chat({**body, "cache": {"no-cache": True}}).headers["x-cache"] == "BYPASS"
    assert "x-cache" not in stack.chat({**body, "temperature": 0.7}).headers
    # the ledger records the hit: no shard, every prompt token cached
    rows = stack.ledger_rows([first.headers["x-request-id"], again.headers["x-request-id"]])
    assert rows[again.headers["x-request-id"]][0] == "response-cache"
    assert rows[again.headers["x-request-id"]][2] == rows[again.headers["x-request-id"]][1]
    assert rows[first.headers["x-request-id"]][0] != "response-cache"
    metrics = scrape(stack.gateway.url)
    assert 'switchboard_response_cache_lookups_total{api="chat",result="hit"} 4.0' in metrics
    assert 'switchboard_response_cache_lookup_seconds_count{api="chat",result="hit",source="local"} 4.0' in metrics


def test_response_cache_serves_the_responses_api_and_whole_chains_only(stack: Stack) -> None:
    sdk = stack.sdk()
    stored = metric(stack.gateway.url, "switchboard_response_cache_stores_total", result="ok")
    one = sdk.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=6, temperature=0)
    written(stack, stored)
    two = sdk.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=6, temperature=0)
    assert two.output_text == one.output_text and two.id != one.id
    assert two.usage.input_tokens_details.cached_tokens == two.usage.input_tokens
    # the same new message on different chains is a different request
    chained = sdk.responses.create(model=MODEL, input="Name a fruit.", previous_response_id=one.id,
                                   max_output_tokens=6, temperature=0)
    assert chained.usage.input_tokens > one.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens < chained.usage.input_tokens


def test_text_format_and_function_tools_through_the_chat_path(stack: Stack) -> None:
    sdk = stack.sdk()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    out = sdk.responses.create(model=MODEL, input="Name the capital of France as JSON.", max_output_tokens=32,
                               text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                "strict": True}}, temperature=0)
    assert set(json.loads(out.output_text)) == {"city"}
    tool = {"type": "function", "name": "weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    call = sdk.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                tool_choice="required", max_output_tokens=48, temperature=0)
    fc = [i for i in call.output if i.type == "function_call"]
    assert fc and fc[0].name == "weather" and "city" in json.loads(fc[0].arguments)
    # the tools' outputs answer the stored calls (previous_response_id): a text reply (each call needs its
    # output, as at OpenAI: one left unanswered is a 400, test_responses_conformance.py)
    done = sdk.responses.create(model=MODEL, previous_response_id=call.id, tools=[tool], max_output_tokens=24,
                                input=[{"type": "function_call_output", "call_id": f.call_id,
                                        "output": '{"forecast": "sunny"}'} for f in fc], temperature=0)
    assert done.status in ("completed", "incomplete") and done.output
    assert [i.type for i in sdk.responses.input_items.list(done.id).data] == ["function_call_output"] * len(fc)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}], max_output_tokens=4)
    assert e.value.body["param"] == "tools[0].type"


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item_not_a_completed_one(stack: Stack) -> None:
    """A function call whose arguments the output limit cut is no call an app may run: the item says
    "incomplete" (the response too, reason max_output_tokens), streamed and not; a whole call is
    "completed"."""
    sdk = stack.sdk()
    tool = {"type": "function", "name": "weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [tool], "tool_choice": "required",
           "parallel_tool_calls": False, "temperature": 0}
    whole = sdk.responses.create(**ask, max_output_tokens=48)
    assert [i.status for i in whole.output if i.type == "function_call"] == ["completed"]
    cut = sdk.responses.create(**ask, max_output_tokens=16)  # greedy: cut inside '{"city":"Paris"}'
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    calls = [i for i in cut.output if i.type == "function_call"]
    assert [i.status for i in calls] == ["incomplete"] and calls[0].arguments != whole.output[0].arguments, cut.output
    with sdk.responses.stream(**ask, max_output_tokens=16) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    (final,) = [e.response for e in events if e.type == "response.incomplete"]
    assert [i.status for i in done if i.type == "function_call"] == ["incomplete"]
    assert [i.status for i in final.output if i.type == "function_call"] == ["incomplete"]
    stored = sdk.responses.retrieve(cut.id)
    assert [i.status for i in stored.output if i.type == "function_call"] == ["incomplete"]


def test_a_streamed_responses_request_is_served_from_the_cache_too(stack: Stack) -> None:
    sdk = stack.sdk()
    ask = {"model": MODEL, "input": "Name an animal.", "max_output_tokens": 6, "temperature": 0}
    stored = metric(stack.gateway.url, "switchboard_response_cache_stores_total", result="ok")
    first = sdk.responses.create(**ask)
    written(stack, stored)
    with sdk.responses.stream(**ask) as stream:
        events = list(stream)
    final = events[-1].response
    assert final.output_text == first.output_text and final.id != first.id
    assert final.usage.input_tokens_details.cached_tokens == final.usage.input_tokens


def test_agents_sdk_responses_model_with_a_function_tool_and_an_output_type(stack: Stack) -> None:
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel, Field

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    class Report(BaseModel):
        city: str = Field(max_length=24)
        summary: str = Field(max_length=40)

    client = openai.AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    # the two halves apart, as with chat completions (the 135M model keeps calling a tool it is given;
    # one call per turn, or the Responses API reports the reply incomplete at max_output_tokens)
    tool_agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                       model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                                                parallel_tool_calls=False),
                       tool_use_behavior="stop_on_first_tool")
    typed = Agent(name="report", instructions="Report the weather in Paris: it is sunny.", output_type=Report,
                  model=model, model_settings=ModelSettings(temperature=0, max_tokens=80))

    async def run() -> tuple[str, object]:
        first = await Runner.run(tool_agent, "What is the weather in Paris?", max_turns=2)
        second = await Runner.run(typed, "Report.", max_turns=1)
        return str(first.final_output), second.final_output

    text, report = asyncio.run(run())
    assert calls and text == f"Sunny in {calls[0]}"
    assert isinstance(report, Report)


def test_background_response_with_the_real_model(stack: Stack) -> None:
    """`background=True` runs the same request apart from the connection: the same greedy text as the
    foreground create, polled with retrieve, its events followed again from a sequence number."""
    sdk = stack.sdk()
    ask = {"model": MODEL, "input": "Name the capital of France.", "instructions": SYSTEM,
           "max_output_tokens": 12, "temperature": 0}
    fg = sdk.responses.create(**ask, extra_headers={"Cache-Control": "no-cache"})
    bg = sdk.responses.create(**ask, background=True, extra_headers={"Cache-Control": "no-cache"})
    assert bg.status in ("queued", "in_progress") and bg.background is True
    eventually(lambda: sdk.responses.retrieve(bg.id).status not in ("queued", "in_progress"), 60,
               what="the background response done")
    done = sdk.responses.retrieve(bg.id)
    assert done.output_text == fg.output_text and "Paris" in done.output_text
    with sdk.responses.retrieve(bg.id, stream=True, starting_after=2) as events:
        got = list(events)
    assert got[0].sequence_number == 3 and got[-1].response.output_text == fg.output_text
