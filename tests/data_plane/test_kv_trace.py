"""A turn's KV fetch from the cache nodes is one trace with the turn: the shard's KVRemote sends the current
trace's `traceparent` and the cache node's `cache_node.kv_*` span continues it. Both were missing: every fetch
was a root trace of its own on the node, nothing in the turn's trace led to it. A real cache node; the
shard side is the KVRemote the shard runs, called inside a span as KVTier.prepare calls it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from data_plane.kv_wire import HASH_BYTES, BlockHeader, encode_frame
from data_plane.membership.view import Member, StaticMembership
from data_plane.shard.kv_remote import KVRemote
from tests.support.cluster import start_cache_nodes
from tests.support.procs import Service


@pytest.fixture(scope="module")
def node() -> Iterator[Service]:
    (proc,) = start_cache_nodes(1)
    yield proc
    proc.stop()


def _in_a_span(trace_id: int, span_id: int) -> object:
    """Attach a sampled span context, as the shard's `shard.generate` is current around the fetch."""
    ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return context.attach(trace.set_span_in_context(NonRecordingSpan(ctx)))


def test_a_kv_fetch_and_store_continue_the_callers_trace(node: Service) -> None:
    trace_id, span_id = uuid.uuid4().int, uuid.uuid4().int >> 64
    session = f"s-{uuid.uuid4().hex}"
    block = bytes(range(HASH_BYTES))
    frame = encode_frame(BlockHeader(block, "m", "float32", "kv", (1,)), b"kvkv")

    async def run() -> None:
        token = _in_a_span(trace_id, span_id)
        try:
            async with httpx.AsyncClient() as http:
                remote = KVRemote(StaticMembership([Member("cache-0", "cache", node.url)]), http)
                assert await remote.store(session, 1, [], [frame], None) == 1
                assert await remote.fetch(session, 1, [block], skip=0) is not None
        finally:
            context.detach(token)  # type: ignore[arg-type]

    asyncio.run(run())
    spans = httpx.get(f"{node.url}/debug/spans", params={"trace_id": format(trace_id, "032x")}, timeout=5).json()
    ops = {s["name"]: s["parent_span_id"] for s in spans}
    assert ops == {"cache_node.kv_put": format(span_id, "016x"), "cache_node.kv_fetch": format(span_id, "016x")}, spans


def test_a_turns_kv_offload_is_a_trace_of_its_own_linked_to_the_turn(node: Service) -> None:
    """The offload after a turn is background work: it started traces with nothing leading back to the turn
    (each cache node's kv_put a root of its own). Its shard.kv_offload span now starts its own trace, linked
    to the turn's shard.generate (KVTier.prepare keeps that span's context on the session ref), and the
    node's kv_put continues it."""
    import torch

    from data_plane.common.tracing import LeanSpan, LeanTracerProvider, Sampler
    from data_plane.shard.engines.base import KVSessionRef
    from data_plane.shard.kv_tier import _Export
    from tests.support.kv import SHAPE, kv_tier

    turn = SpanContext(uuid.uuid4().int, uuid.uuid4().int >> 64, is_remote=False,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))
    ended: list[LeanSpan] = []
    tier = kv_tier()
    tier.tracer = LeanTracerProvider(ended.append, Sampler(1.0, True)).get_tracer("t")
    hashes = [bytes([i]) * HASH_BYTES for i in range(2)]
    job = _Export(KVSessionRef(f"s-{uuid.uuid4().hex}", 1, None, turn), hashes, 0, torch.zeros(2, *SHAPE))

    async def run() -> None:
        async with httpx.AsyncClient() as http:
            tier.remote = KVRemote(StaticMembership([Member("cache-0", "cache", node.url)]), http)
            await tier._offload(job)

    asyncio.run(run())
    (offload,) = [s for s in ended if s.name == "shard.kv_offload"]
    own = offload.get_span_context()
    assert own.trace_id != turn.trace_id and offload.parent is None
    assert [link.context.span_id for link in offload.links] == [turn.span_id]
    assert offload.attributes["switchboard.kv.blocks"] == 2
    spans = httpx.get(f"{node.url}/debug/spans", params={"trace_id": format(own.trace_id, "032x")}, timeout=5).json()
    assert [(s["name"], s["parent_span_id"]) for s in spans] == [("cache_node.kv_put", format(own.span_id, "016x"))]


def test_prepare_keeps_the_turns_span_for_its_offload() -> None:
    from types import SimpleNamespace

    from data_plane.shard.engines.base import GenerationRequest, KVSessionRef, SamplingParams
    from tests.support.kv import kv_tier

    tier = kv_tier()
    tier.prefix.hashes = lambda *args: []  # type: ignore[union-attr,method-assign]  # nothing to fetch: prepare returns early
    tier.prefix.cache = SimpleNamespace(probe=lambda hashes, usable: 0)  # type: ignore[union-attr]
    turn = SpanContext(uuid.uuid4().int, uuid.uuid4().int >> 64, is_remote=False,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))
    req = GenerationRequest("r-1", [1], SamplingParams(), kv_session=KVSessionRef("s-1"))
    assert asyncio.run(tier.prepare(req, NonRecordingSpan(turn))) == 0
    assert req.kv_session is not None and req.kv_session.origin == turn


def test_a_kv_fetch_that_asks_the_next_replica_sends_it_the_cluster_token() -> None:
    """A replica that answers with fewer blocks is followed by the next one; the loop read that answer into the
    variable that held the request's headers, so the next replica was sent the first one's response headers (a
    second content-length, no cluster token): refused, and the session's KV on it never fetched."""
    seen: list[dict[str, str]] = []

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")[1:]
        headers = [line.partition(":") for line in head if line]
        seen.append({k.strip().lower(): v.strip() for k, _, v in headers})
        await reader.readexactly(int(seen[-1]["content-length"]))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\nx-kv-run: 0\r\n"
                     b"content-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def run() -> None:
        servers = [await asyncio.start_server(node, "127.0.0.1", 0) for _ in range(2)]
        members = [Member(f"cache-{i}", "cache", f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}")
                   for i, s in enumerate(servers)]
        async with httpx.AsyncClient() as http:
            remote = KVRemote(StaticMembership(members), http, headers={"authorization": "Bearer cluster-token"})
            assert await remote.fetch("s-1", 2, [bytes(HASH_BYTES)], skip=0) is not None
        for s in servers:
            s.close()

    asyncio.run(run())
    assert len(seen) == 2
    assert all(h.get("authorization") == "Bearer cluster-token" and "x-kv-run" not in h for h in seen), seen
