"""Context that outlives the window, end to end: recall and compaction through the Responses API.

Synthetic shards (whitespace tokens) and a gateway run with --log-prompts, so each test reads the
exact context the gateway sent to the model from its log. Conversations come from
`switchboard bench memory`'s generator: 120 turns, a fact planted in the first quarter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from data_plane.bench.memory import Planted, generate
from tests.support.cluster import KEYS, Cluster
from tests.support.metrics import scrape


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(shards=1, caches=2, gateway_args=["--log-prompts"]) as c:
        yield c


def fact(p: Planted) -> str:
    return p.messages[p.planted_index]["content"].split(".")[0]


def post(c: Cluster, path: str, body: dict, key: str = "plus") -> httpx.Response:
    return httpx.post(c.gateway.url + path, json=body, headers={"Authorization": f"Bearer {KEYS[key]}"}, timeout=60)


def sent_prompt(c: Cluster, r: httpx.Response) -> str:
    """The prompt the gateway logged for the request `r` answered."""
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    lines = [line for line in c.gateway.log_path.read_text().splitlines() if f"request {rid} prompt=" in line]
    assert len(lines) == 1
    return lines[0]


def conversation(c: Cluster, p: Planted, key: str = "plus") -> str:
    """A stored conversation of `p`'s messages, 20 items a request (OpenAI's limit on one add)."""
    items = [{"type": "message", **m} for m in p.messages]
    r = post(c, "/v1/conversations", {"items": items[:20]}, key)
    assert r.status_code == 200, r.text
    conv = r.json()["id"]
    for start in range(20, len(items), 20):
        r = post(c, f"/v1/conversations/{conv}/items", {"items": items[start:start + 20]}, key)
        assert r.status_code == 200, r.text
    return conv


def test_recall_brings_back_a_fact_from_before_the_window_and_only_this_conversations(cluster: Cluster) -> None:
    a, b = generate(1, 120), generate(2, 120)
    conv_a, conv_b = conversation(cluster, a), conversation(cluster, b)
    ask = {"input": a.question, "truncation": "auto", "max_output_tokens": 4, "temperature": 0}
    with_recall = sent_prompt(cluster, post(cluster, "/v1/responses", {**ask, "conversation": conv_a}))
    assert fact(a) in with_recall and "Earlier in this conversation (recalled):" in with_recall
    assert fact(b) not in with_recall
    # the same question in another conversation of the same key: never the first one's text
    elsewhere = sent_prompt(cluster, post(cluster, "/v1/responses", {**ask, "conversation": conv_b}))
    assert fact(a) not in elsewhere
    # without recall the sliding window has lost it; with truncation disabled it is a 400
    window_only = sent_prompt(cluster, post(cluster, "/v1/responses",
                                            {**ask, "conversation": conv_a, "context_recall": False}))
    assert fact(a) not in window_only
    r = post(cluster, "/v1/responses", {**ask, "conversation": conv_a, "truncation": "disabled"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    metrics = scrape(cluster.gateway.url)
    assert 'switchboard_context_recall_total{result="recalled"}' in metrics


def test_compaction_item_stands_for_earlier_turns_and_opens_for_its_key_only(cluster: Cluster) -> None:
    p = generate(3, 120)
    r = post(cluster, "/v1/responses/compact", {"input": [{"type": "message", **m} for m in p.messages],
                                                "keep_tokens": 200})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response.compaction"
    item, kept = body["output"][0], body["output"][1:]
    assert item["type"] == "compaction" and 1 <= len(kept) < len(p.messages)
    assert fact(p) not in item["encrypted_content"]
    assert body["usage"]["input_tokens"] > 5000
    follow = {"input": [*body["output"], {"role": "user", "content": p.question}], "truncation": "auto",
              "max_output_tokens": 4}
    sent = sent_prompt(cluster, post(cluster, "/v1/responses", follow))
    assert "Summary of the earlier conversation:" in sent and fact(p) in sent
    # another tenant's key cannot open it (nor can another key of the same tenant)
    for key in ("enterprise", "plus2"):
        denied = post(cluster, "/v1/responses", follow, key=key)
        assert denied.status_code == 400 and denied.json()["error"]["code"] == "invalid_encrypted_content"
        assert fact(p) not in denied.text


def test_context_management_compacts_a_conversation_off_the_request_path(cluster: Cluster) -> None:
    p = generate(4, 60)
    conv = conversation(cluster, p)
    r = post(cluster, "/v1/responses", {"input": "Hello again.", "conversation": conv, "truncation": "auto",
                                        "max_output_tokens": 4,
                                        "context_management": [{"type": "compaction", "compact_threshold": 800}]})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while True:
        items = httpx.get(f"{cluster.gateway.url}/v1/conversations/{conv}/items?order=asc&limit=100",
                          headers={"Authorization": f"Bearer {KEYS['plus']}"}).json()["data"]
        if items[0]["type"] == "compaction" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert items[0]["type"] == "compaction" and len(items) < 2 * 60
    sent = sent_prompt(cluster, post(cluster, "/v1/responses", {"input": p.question, "conversation": conv,
                                                                "truncation": "auto", "max_output_tokens": 4}))
    assert fact(p) in sent
    metrics = scrape(cluster.gateway.url)
    done = [line for line in metrics.splitlines() if line.startswith('switchboard_context_compactions_total{trigger="threshold"}')]
    assert float(done[0].rsplit(" ", 1)[1]) >= 1  # the conversation, and the stored response


def test_the_next_turn_is_not_refused_while_the_last_ones_compaction_runs(cluster: Cluster) -> None:
    """Background compaction starts the moment a turn is saved and holds the conversation's lock for
    its load-compact-save; turns sent back to back, with compaction running between them, are all
    answered. Whether one lands inside a compaction is up to timing here, so the rule itself (a turn
    waits for a compaction, is refused only by another turn) is tests/data_plane/test_record_locks.py's."""
    p = generate(5, 60)
    conv = conversation(cluster, p)
    manage = {"conversation": conv, "truncation": "auto", "max_output_tokens": 4,
              "context_management": [{"type": "compaction", "compact_threshold": 400}]}
    for i in range(4):
        r = post(cluster, "/v1/responses", {**manage, "input": f"Turn {i}."})
        assert r.status_code == 200, r.text
    items = httpx.get(f"{cluster.gateway.url}/v1/conversations/{conv}/items?order=asc&limit=100",
                      headers={"Authorization": f"Bearer {KEYS['plus']}"}).json()["data"]
    assert items[0]["type"] == "compaction"  # compaction did run between the turns


def test_a_compaction_item_another_key_made_is_refused_when_added_not_at_every_later_turn(cluster: Cluster) -> None:
    """A conversation took any compaction item, then refused each of its turns with a 400 until the item was
    deleted by hand; the item is now checked when it is added (create and items.create), and one this key made
    is still taken."""
    p = generate(4, 40)
    made = post(cluster, "/v1/responses/compact", {"input": [{"type": "message", **m} for m in p.messages],
                                                   "keep_tokens": 100})
    assert made.status_code == 200, made.text
    compaction = made.json()["output"][0]
    forged = {"type": "compaction", "encrypted_content": "not-sealed-by-us"}
    for key, item in (("enterprise", compaction), ("plus", forged)):  # another tenant's item; a made-up one
        r = post(cluster, "/v1/conversations", {"items": [{"role": "user", "content": "hi"}, item]}, key=key)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_encrypted_content" and r.json()["error"]["param"] == "items[1]"
        conv = post(cluster, "/v1/conversations", {}, key=key).json()["id"]
        r = post(cluster, f"/v1/conversations/{conv}/items", {"items": [item]}, key=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "items[0]", r.text
        turn = post(cluster, "/v1/responses", {"input": "go on", "conversation": conv, "max_output_tokens": 2}, key=key)
        assert turn.status_code == 200, turn.text
    conv = post(cluster, "/v1/conversations", {"items": [compaction]}).json()["id"]
    turn = post(cluster, "/v1/responses", {"input": p.question, "conversation": conv, "max_output_tokens": 2})
    assert "Summary of the earlier conversation:" in sent_prompt(cluster, turn)


def test_the_input_tokens_count_with_truncation_auto_is_what_create_sends(cluster: Cluster) -> None:
    """OpenAI's input_tokens count is "the exact number of tokens the model receives", and it takes
    `truncation`. With truncation "auto" and a conversation past the window, ours counted the whole
    conversation (several times the context) while create sent the window. Now the count is create's
    `usage.input_tokens`, with recall or without; with truncation disabled it is still the whole."""
    p = generate(4, 120)
    conv = conversation(cluster, p)
    ask = {"input": p.question, "conversation": conv, "truncation": "auto"}

    def count(body: dict) -> int:
        r = post(cluster, "/v1/responses/input_tokens", body)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    whole = count({**ask, "truncation": "disabled"})
    for recall in ({}, {"context_recall": False}):  # recall on (the default), then the plain window
        counted = count({**ask, **recall})
        created = post(cluster, "/v1/responses", {**ask, **recall, "store": False, "temperature": 0})
        assert created.status_code == 200, created.text
        assert counted == created.json()["usage"]["input_tokens"] < whole / 2, (recall, counted, whole)
    # a new message too long for any window: create's 400, but a count is never refused for its size
    huge = {"input": "word " * 6000, "truncation": "auto"}
    assert count(huge) == count({**huge, "truncation": "disabled"}) > 6000
