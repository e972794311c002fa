"""A chat session whose turn the client abandons mid-stream (the app's "stop" button): the turn is
dropped, never half kept, and the session id the client holds keeps working, the first turn's too.
Real control plane, cache nodes, synthetic shard and gateway on loopback."""

from __future__ import annotations

from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.support.cluster import KEYS, Cluster


@pytest.fixture(scope="module")
def cluster():
    with Cluster(shards=1, token_delay_ms=20.0) as c:
        yield c


def sdk(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0)


def abandon(c: Cluster, sid: str, messages: list[Any]) -> str:
    """Stream a turn on `sid`, close it after the first words; the session id the headers gave."""
    raw = sdk(c).chat.completions.with_raw_response.create(
        model="synthetic", messages=messages, max_tokens=200, stream=True, extra_headers={"X-Session-Id": sid})
    got = raw.headers["x-session-id"]
    stream = cast("openai.Stream[ChatCompletionChunk]", raw.parse())
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    return got


def next_turn(c: Cluster, sid: str) -> httpx.Response:
    return httpx.post(c.gateway.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['plus']}", "X-Session-Id": sid},
                      json={"messages": [{"role": "user", "content": "shorter please"}], "max_tokens": 3})


def test_a_first_turn_abandoned_mid_stream_leaves_a_session_that_works(cluster: Cluster) -> None:
    """The id came in the stream's headers; the user stopped the reply: the next turn on that id is
    served (it was a 404 session_not_found), with the first turn's system prompt and nothing of the
    abandoned question or its half answer."""
    sid = abandon(cluster, "new", [{"role": "system", "content": "you are a pirate"},
                                   {"role": "user", "content": "tell me a very long story"}])
    r = next_turn(cluster, sid)
    assert r.status_code == 200, r.text
    # synthetic tokenizer: one token a word plus one per role marker, one for the reply's primer
    assert r.json()["usage"]["prompt_tokens"] == (1 + 4) + (1 + 2) + 1


def test_a_later_turn_abandoned_is_dropped_whole(cluster: Cluster) -> None:
    r0 = httpx.post(cluster.gateway.url + "/v1/chat/completions", timeout=30,
                    headers={"Authorization": f"Bearer {KEYS['plus']}", "X-Session-Id": "new"},
                    json={"messages": [{"role": "user", "content": "my name is ann"}], "max_tokens": 3})
    sid, before = r0.headers["x-session-id"], r0.json()["usage"]["total_tokens"]
    assert abandon(cluster, sid, [{"role": "user", "content": "tell me a very long story"}]) == sid
    r = next_turn(cluster, sid)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == before + 1 + (1 + 2)  # the assistant marker, the new turn
