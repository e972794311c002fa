"""Greedy chat turns sent straight to a shard with a KV session, and what they report, for the KV
tier's tests (real processes, the real model).

    session, salt = fresh()                                    # nothing cached can match them
    t2, r1 = two_turns(shard_a, STORY, session, salt)          # turn 1 stored on the cache nodes
    r2 = direct(shard_b, t2, session=session, salt=salt)       # turn 2 elsewhere: fetched KV
    assert cached(r2) >= 4 * BLOCK and text(r2) == reference(shard_b, t2)
    span_event(shard_b, r2["request_id"], "kv_fetch")          # the shard span's event attributes

Used by tests/data_plane/test_kv_tier.py and test_pipeline_kv.py.
"""

from __future__ import annotations

import time
import uuid

import httpx

from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service

BLOCK = 16
"""Tokens per KV block (the shard's default `--kv-block-size`)."""
MAX_TOKENS = 24
"""Each turn's max_tokens."""
STORY = ("Tell me, in plain words, how a bicycle's gears, chain and derailleur work together when a rider "
         "climbs a steep hill, and why the cassette has so many sprockets. ")
"""A long user prompt (tests repeat it to span several whole blocks)."""


def total(url: str, name: str, **labels: str) -> float:
    """A counter's value on a live process's /metrics; 0 while the series does not exist yet."""
    try:
        return metric(url, name, **labels)
    except (AssertionError, KeyError, StopIteration, ValueError):
        return 0.0


def direct(shard: Service, messages: list[dict[str, str]], *, session: str | None, salt: str,
           replicas: int = 2) -> dict:
    """One greedy turn sent straight to a shard, as the gateway would send it."""
    body: dict = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "cache_salt": salt,
                  "request_id": uuid.uuid4().hex}
    if session:
        body.update(session_id=session, kv_replicas=replicas, kv_ttl_s=600)
    r = httpx.post(shard.url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    return {**r.json(), "request_id": body["request_id"]}


def reference(shard: Service, messages: list[dict[str, str]]) -> str:
    """The same turn computed from scratch (a fresh salt: nothing cached can match, no session)."""
    return direct(shard, messages, session=None, salt=uuid.uuid4().hex)["choices"][0]["message"]["content"]


def fresh() -> tuple[str, str]:
    """A new session id and tenant salt: nothing any earlier test left in a prefix cache can match."""
    return "sess_" + uuid.uuid4().hex, "tenant:" + uuid.uuid4().hex


def text(resp: dict) -> str:
    """The completion's text."""
    return resp["choices"][0]["message"]["content"]


def cached(resp: dict) -> int:
    """Prompt tokens served from cached KV (the prefix cache or fetched blocks)."""
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_offloaded(shard: Service, before: float, timeout: float = 60.0) -> None:
    """Until the shard has stored more blocks on the cache nodes than `before`."""
    deadline = time.monotonic() + timeout
    while total(shard.url, "switchboard_shard_kv_offload_blocks_total", result="stored") <= before:
        assert time.monotonic() < deadline, "the turn's KV blocks never reached the cache nodes"
        time.sleep(0.2)


def span_event(shard: Service, request_id: str, name: str) -> dict:
    """The attributes of event `name` on the request's `shard.generate` span (/debug/spans)."""
    spans = httpx.get(shard.url + "/debug/spans", headers=CLUSTER_HEADERS).json()
    span = next(s for s in spans if s["name"] == "shard.generate"
                and s["attributes"].get("switchboard.request_id") == request_id)
    return next(e for e in span["events"] if e["name"] == name)["attributes"]


def two_turns(a: Service, content: str, session: str, salt: str) -> tuple[list[dict[str, str]], dict]:
    """Turn 1 on shard `a` (its blocks go to the cache nodes); the messages of turn 2."""
    stored = total(a.url, "switchboard_shard_kv_offload_blocks_total", result="stored")
    t1 = [{"role": "user", "content": content}]
    r1 = direct(a, t1, session=session, salt=salt)
    wait_offloaded(a, stored)
    return t1 + [{"role": "assistant", "content": text(r1)}, {"role": "user", "content": "And when going downhill?"}], r1
