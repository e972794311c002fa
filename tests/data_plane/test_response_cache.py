"""The response cache's decisions (what may be cached, the key) and its failure mode, without a cluster
(the end-to-end behaviour is in test_responses_api.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from data_plane.cache.client import SessionStore
from data_plane.gateway.response_cache import (
    CachedReply,
    Decision,
    LocalReplies,
    ResponseCache,
    ResponseCacheMetrics,
    cache_key,
    cache_policy,
)
from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.hop_client import HopPool
from tests.support.cluster import start_cache_nodes


def test_only_deterministic_requests_are_cached_and_opt_outs_follow_litellm() -> None:
    assert cache_policy(None, None, None, None, {}).decision is Decision.NONDETERMINISTIC
    assert cache_policy(0.7, None, None, None, {}).decision is Decision.NONDETERMINISTIC
    assert cache_policy(0.7, 42, None, None, {}).read  # a seed makes sampling repeatable
    assert not cache_policy(0, None, [{"type": "function"}], None, {}).read  # tool calls are not replayed
    full = cache_policy(0, None, None, None, {})
    assert full.read and full.write
    assert cache_policy(0, None, None, {"no-cache": True}, {}) == cache_policy(0, None, None, None, {
        "cache-control": "no-cache"})
    no_cache = cache_policy(0, None, None, {"no-cache": True}, {})
    assert not no_cache.read and no_cache.write and no_cache.decision is Decision.BYPASS
    no_store = cache_policy(0, None, None, None, {"cache-control": "no-store"})
    assert no_store.read and not no_store.write


def test_the_key_holds_the_tenant_and_the_whole_prompt_not_the_request_ids() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    key = cache_key("acme", {**body, "request_id": "a", "deadline": 1.0}, body["messages"])
    assert key == cache_key("acme", {**body, "request_id": "b", "deadline": 2.0}, body["messages"])
    assert key != cache_key("bigco", body, body["messages"])
    assert key != cache_key("acme", {**body, "max_tokens": 5}, body["messages"])
    longer = [{"role": "user", "content": "earlier"}, *body["messages"]]  # same window, other transcript
    assert key != cache_key("acme", body, longer)


def test_no_cache_node_is_a_miss_never_an_error() -> None:
    registry = CollectorRegistry()

    async def lookup() -> object:
        pool = HopPool()
        try:
            store = SessionStore(StaticMembership([]), pool, timeout_s=0.1, prefix="/v1/response-cache")
            return await ResponseCache(store, ResponseCacheMetrics(registry), 60).get("rc_x", "acme", "chat")
        finally:
            await pool.aclose()

    assert asyncio.run(lookup()) is None
    assert registry.get_sample_value("switchboard_response_cache_lookups_total",
                                     {"api": "chat", "result": "error"}) == 1


def test_a_gateway_answers_its_own_copy_without_a_round_trip_never_to_another_tenant() -> None:
    registry = CollectorRegistry()
    reply = CachedReply("four", "stop", 3, 1)

    async def lookups() -> tuple[object, object, object]:
        pool = HopPool()
        try:  # no cache node at all: only this gateway's copy can answer
            store = SessionStore(StaticMembership([]), pool, timeout_s=0.1, prefix="/v1/response-cache")
            cache = ResponseCache(store, ResponseCacheMetrics(registry), 60)
            cache.put_later("rc_k", "acme", reply)
            await cache.drain()  # the node write fails (no node); the local copy stays
            return (await cache.get("rc_k", "acme", "chat"), await cache.get("rc_k", "bigco", "chat"),
                    await cache.get("rc_other", "acme", "chat"))
        finally:
            await pool.aclose()

    own, other_tenant, other_key = asyncio.run(lookups())
    assert own == reply and other_tenant is None and other_key is None
    sample = registry.get_sample_value
    assert sample("switchboard_response_cache_lookup_seconds_count",
                  {"api": "chat", "result": "hit", "source": "local"}) == 1
    assert sample("switchboard_response_cache_lookups_total", {"api": "chat", "result": "hit"}) == 1
    assert sample("switchboard_response_cache_lookups_total", {"api": "chat", "result": "error"}) == 2


def test_local_copies_are_bounded_in_bytes_expire_and_are_bound_to_their_owner() -> None:
    local = LocalReplies(1000)
    reply = CachedReply("x" * 300, "stop", 1, 1)
    local.put("k1", "o", reply, time.time() + 60)
    local.put("k2", "o", reply, time.time() + 60)
    assert local.get("k1", "o") == reply and local.get("k1", "other") is None
    local.put("k3", "o", reply, time.time() + 60)  # over budget: the least recently used (k2) goes
    assert local.get("k2", "o") is None and local.get("k1", "o") == reply and local.bytes <= 1000
    local.put("k4", "o", reply, time.time() - 1)  # already expired: not kept
    assert local.get("k4", "o") is None
    local.put("k5", "o", reply, time.time() + 0.05)  # over budget again: k3 goes, k1 was read since
    time.sleep(0.06)
    assert local.get("k5", "o") is None and local.get("k3", "o") is None and local.get("k1", "o") == reply
    assert len(local) == 1
    small = LocalReplies(100)
    small.put("k", "o", reply, time.time() + 60)  # larger than the whole budget: not kept
    assert len(small) == 0 and small.bytes == 0


async def test_a_reply_written_by_one_gateway_is_read_from_the_node_once_then_from_its_own_copy(
        tmp_path: Path) -> None:
    nodes = start_cache_nodes(1, log_dir=tmp_path)
    pool = HopPool()
    try:
        membership = StaticMembership([Member(id="cache-0", service="cache", url=nodes[0].url)])
        registries = [CollectorRegistry(), CollectorRegistry()]
        writer, reader = (ResponseCache(SessionStore(membership, pool, timeout_s=2.0, prefix="/v1/response-cache"),
                                        ResponseCacheMetrics(r), 60) for r in registries)
        reply = CachedReply("four", "stop", 3, 1)
        writer.put_later("rc_shared", "acme", reply)
        await writer.drain()
        assert await reader.get("rc_shared", "acme", "chat") == reply  # from the node: one round trip
        assert await reader.get("rc_shared", "acme", "chat") == reply  # then from its own copy
        assert await reader.get("rc_shared", "bigco", "chat") is None  # the node refuses another owner
        assert reader.local is not None and len(reader.local) == 1
        sample = registries[1].get_sample_value
        for source in ("nodes", "local"):
            assert sample("switchboard_response_cache_lookup_seconds_count",
                          {"api": "chat", "result": "hit", "source": source}) == 1
    finally:
        await pool.aclose()
        for n in nodes:
            n.stop()
