"""Stored Chat Completions end to end (`store: true`, then retrieve, list, update, messages, delete):
the real model (the session's fp32 shard), two cache nodes and a gateway, driven by the openai SDK.
The stack is test_responses_api's (module-scoped: a gateway and cache nodes of this module's own)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.data_plane import test_responses_api
from tests.data_plane.test_responses_api import MODEL, Stack, assert_gone
from tests.support.cluster import CLUSTER_HEADERS, KEYS, stored_session
from tests.support.metrics import metric
from tests.support.procs import Service

stack = test_responses_api.stack
"""The module-scoped fixture: a gateway and two cache nodes of this module's own, the session's shard."""

MESSAGES: list[Any] = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"}]


def tag() -> str:
    return uuid.uuid4().hex[:12]


def test_store_retrieve_messages_update_delete(stack: Stack) -> None:
    sdk = stack.sdk()
    before = metric(stack.gateway.url, "switchboard_responses_requests_total", op="chat_retrieve", status="200")
    made = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, store=True,
                                       metadata={"run": "r1"})
    got = sdk.chat.completions.retrieve(made.id)
    assert got.model_dump(exclude={"metadata"}) == made.model_dump(exclude={"metadata"})
    assert got.metadata == {"run": "r1"} and got.choices[0].message.content == made.choices[0].message.content
    held = [c for c in stack.caches if stored_session(c.url, made.id) is not None]
    assert held, "kept on the cache nodes"
    for c in held:  # sealed at rest: the node holds no prompt or reply text
        raw = httpx.get(f"{c.url}/v1/sessions/{made.id}", headers=CLUSTER_HEADERS, timeout=30).text
        assert "capital of France" not in raw and str(made.choices[0].message.content) not in raw
    msgs = sdk.chat.completions.messages.list(made.id)
    assert [(m.role, m.content) for m in msgs.data] == [(m["role"], m["content"]) for m in MESSAGES]
    assert msgs.data[0].id == f"{made.id}-0" and msgs.has_more is False
    one = sdk.chat.completions.messages.list(made.id, limit=1, order="desc")
    assert [m.role for m in one.data] == ["user"] and one.has_more is True
    assert [m.role for m in sdk.chat.completions.messages.list(made.id, after=one.data[0].id, order="desc")] == [
        "system"]
    updated = sdk.chat.completions.update(made.id, metadata={"run": "r2", "k": "v"})
    assert updated.metadata == {"run": "r2", "k": "v"} and updated.id == made.id
    assert sdk.chat.completions.retrieve(made.id).metadata == {"run": "r2", "k": "v"}
    # the tenant's other key sees it (stored completions belong to the tenant); another tenant does not
    assert stack.sdk("plus2").chat.completions.retrieve(made.id).id == made.id
    other = stack.sdk("enterprise")
    for call in (lambda: other.chat.completions.retrieve(made.id), lambda: other.chat.completions.delete(made.id),
                 lambda: other.chat.completions.update(made.id, metadata={"x": "y"}),
                 lambda: other.chat.completions.messages.list(made.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        body: Any = e.value.body
        assert body["param"] == "completion_id" and body["code"] == "not_found"
    assert made.id not in [c.id for c in other.chat.completions.list(limit=100)]
    assert metric(stack.gateway.url, "switchboard_responses_requests_total", op="chat_retrieve",
                  status="200") >= before + 3
    deleted = sdk.chat.completions.delete(made.id)
    assert deleted.id == made.id and deleted.deleted is True and deleted.object == "chat.completion.deleted"
    assert_gone(stack, made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.delete(made.id)
    assert made.id not in [c.id for c in sdk.chat.completions.list(metadata={"run": "r2"}, limit=100)]
    log = stack.gateway.log_tail(200_000)
    assert "capital of France" not in log and "chat completion stored" in log


def test_streamed_with_several_choices_is_stored(stack: Stack) -> None:
    sdk = stack.sdk()
    texts: dict[int, str] = {}
    completion_id = ""
    stream = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.8, seed=7,
                                         n=2, stream=True, store=True)
    for chunk in stream:
        assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
        completion_id = chunk.id
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    got = sdk.chat.completions.retrieve(completion_id)
    assert got.id == completion_id and got.object == "chat.completion"
    assert {c.index: c.message.content for c in got.choices} == texts and len(texts) == 2
    assert got.usage is not None and got.usage.completion_tokens > 0


def test_not_stored_is_404(stack: Stack) -> None:
    sdk = stack.sdk()
    for store in (None, False):
        extra = {} if store is None else {"store": store}
        made = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_body=extra)
        with pytest.raises(openai.NotFoundError) as e:
            sdk.chat.completions.retrieve(made.id)
        body: Any = e.value.body
        assert e.value.status_code == 404 and "not found" in body["message"]
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.messages.list("chatcmpl-nope")
    with pytest.raises(openai.NotFoundError):  # not a session id the cache tier accepts: a 404 all the same
        sdk.chat.completions.retrieve("no such id!")


def test_list_pages_and_filters(stack: Stack) -> None:
    sdk = stack.sdk()
    batch = tag()
    made = [sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}],
                                        max_tokens=4, temperature=0, store=True,
                                        metadata={"batch": batch, "i": str(i)}).id for i in range(3)]
    sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, store=True,
                                metadata={"batch": "other"})
    first = sdk.chat.completions.list(metadata={"batch": batch}, limit=2)
    assert [c.id for c in first.data] == made[:2] and first.has_more is True
    rest = sdk.chat.completions.list(metadata={"batch": batch}, limit=2, after=first.data[-1].id)
    assert [c.id for c in rest.data] == made[2:] and rest.has_more is False
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch}, limit=2)] == made  # auto-paging
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch}, order="desc").data] == made[::-1]
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch, "i": "1"}).data] == [made[1]]
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch}, model=MODEL).data] == made
    assert sdk.chat.completions.list(metadata={"batch": batch}, model="another-model").data == []
    # an update moves the completion's metadata in the list, never its place
    sdk.chat.completions.update(made[0], metadata={"batch": batch, "i": "0", "seen": "yes"})
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch}).data] == made
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch, "seen": "yes"}).data] == made[:1]
    listed = sdk.chat.completions.list(metadata={"batch": batch}).data[0]
    assert listed.model_dump() == sdk.chat.completions.retrieve(made[0]).model_dump()
    # bad parameters are OpenAI-shaped 400s, never a 500
    for query in ({"limit": "0"}, {"limit": "many"}, {"order": "sideways"}, {"after": "chatcmpl-unknown"}):
        r = httpx.get(stack.gateway.url + "/v1/chat/completions", params=query, timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['plus']}"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (query, r.text)
    r = httpx.post(stack.gateway.url + f"/v1/chat/completions/{made[0]}", json={"metadata": {"k": 1}}, timeout=30,
                   headers={"Authorization": f"Bearer {KEYS['plus']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    assert httpx.get(stack.gateway.url + "/v1/chat/completions", timeout=30).status_code == 401


def test_listing_pages_on_past_a_deleted_or_refiltered_cursor(stack: Stack) -> None:
    """The SDK's auto-paging sends `after=<last id of the page>`: an app that deletes what it lists sends an
    id it just deleted (that was a 400 "no item with id", so the loop stopped after the first page), and
    one whose cursor's metadata changed under its filter an id the filter no longer lists."""
    sdk = stack.sdk()
    batch = tag()
    made = [sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}],
                                        max_tokens=2, temperature=0, store=True,
                                        metadata={"batch": batch}).id for i in range(5)]
    seen = []
    for c in sdk.chat.completions.list(metadata={"batch": batch}, limit=2):
        seen.append(c.id)
        sdk.chat.completions.delete(c.id)
    assert seen == made and sdk.chat.completions.list(metadata={"batch": batch}).data == []
    desc = [c.id for c in sdk.chat.completions.list(metadata={"batch": batch}, limit=1, order="desc")]
    assert desc == []  # tombstones are never listed
    kept = [sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, store=True,
                                        metadata={"batch": batch}).id for _ in range(3)]
    first = sdk.chat.completions.list(metadata={"batch": batch}, limit=1, order="desc")
    assert [c.id for c in first.data] == kept[2:]
    sdk.chat.completions.update(kept[2], metadata={"batch": "moved"})
    rest = sdk.chat.completions.list(metadata={"batch": batch}, limit=5, order="desc", after=kept[2])
    assert [c.id for c in rest.data] == kept[1::-1] and rest.has_more is False
    # a cursor at a deleted completion, read in either order
    sdk.chat.completions.delete(kept[1])
    assert [c.id for c in sdk.chat.completions.list(metadata={"batch": batch}, after=kept[1], order="desc")] == [
        kept[0]]
    assert sdk.chat.completions.list(metadata={"batch": batch}, after=kept[1]).data == []
    for cid in (kept[0], kept[2]):
        sdk.chat.completions.delete(cid)


def test_concurrent_stores_and_deletes_of_one_tenant_are_all_listed_then_all_gone(stack: Stack) -> None:
    """The index edits of one tenant that meet share one rewrite (data_plane/gateway/batched_edits.py; the
    rewrite counts are tests/data_plane/test_batched_edits.py's): through the real gateway and cache nodes,
    12 stores at once are all listed, and 12 deletes at once leave none."""
    from concurrent.futures import ThreadPoolExecutor

    sdk, batch = stack.sdk(), tag()

    def store(i: int) -> str:
        return sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}],
                                           max_tokens=2, temperature=0, store=True,
                                           metadata={"batch": batch}).id

    with ThreadPoolExecutor(12) as pool:
        made = set(pool.map(store, range(12)))
        assert {c.id for c in sdk.chat.completions.list(metadata={"batch": batch}, limit=100)} == made
        list(pool.map(lambda cid: sdk.chat.completions.delete(cid), made))
    assert list(sdk.chat.completions.list(metadata={"batch": batch}, limit=100)) == []


def test_a_stored_completion_keeps_the_fingerprint_of_the_shard_that_made_it(stack: Stack, fp32_shard: Service) -> None:
    """`system_fingerprint` is the serving shard's (its numerics: data_plane/shard/engines/fingerprint.py), streamed
    or not, and a stored completion keeps the value it was made with (it was the constant "fp_switchboard_1")."""
    card = httpx.get(fp32_shard.url + "/v1/models", headers=CLUSTER_HEADERS, timeout=30).json()["data"][0]
    fp = card["system_fingerprint"]
    assert fp.startswith("fp_") and fp != "fp_switchboard_1"
    sdk = stack.sdk()
    made = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, store=True)
    assert made.system_fingerprint == fp == sdk.chat.completions.retrieve(made.id).system_fingerprint
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=3, stream=True,
                                              store=True, stream_options={"include_usage": True}))
    assert {c.system_fingerprint for c in chunks} == {fp}
    assert sdk.chat.completions.retrieve(chunks[0].id).system_fingerprint == fp
