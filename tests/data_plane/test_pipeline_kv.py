"""The KV tier through a pipeline (data_plane/shard/engines/pipeline_kv.py KVHops.gather / insert),
with real processes and the real model (float32, greedy): a cache node, a plain shard and a 3-stage
pipelined shard (a middle stage and a last one: their parts come back differently). Blocks are
whole on the cache nodes whichever kind of shard made them, so:

- a conversation stored by the plain shard is fetched by the pipelined shard, which has never seen
  it (stage 0 scatters each stage its layers of the fetched blocks): its next turn is served from
  the fetched KV and answers exactly what computing it does;
- a conversation stored by the pipelined shard (stage 0 gathers the later stages' layers) is
  fetched by the plain shard: the same;
- ... also when the turn ends while another stream's passes are in flight (the batch queue, on by
  default): the GATHER rides behind them and completes with the newest (span attribute
  `switchboard.pipeline.deferred`).

Each transfer is a span under the request's `shard.generate` with its blocks and bytes.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Self

import httpx
import pytest

from tests.support.cluster import Cluster
from tests.support.formats import INVARIANT_ARGS
from tests.support.kv_turns import BLOCK, STORY, cached, direct, fresh, reference, span_event, text, total, two_turns
from tests.support.procs import CLUSTER_HEADERS, Service

pytestmark = pytest.mark.slow

SHARD_ARGS = [*INVARIANT_ARGS, "--max-num-seqs", "4", "--speculation", "off"]
STAGES = 3  # 30 layers, the head on stage 0 counted as 8: 0-4 | 5-17 | 18-29
LATER_LAYERS = 25
PER_BLOCK = 2 * LATER_LAYERS * 3 * BLOCK * 64 * 4  # the later stages' layers of one fp32 block: K and V


@pytest.fixture(scope="module")
def shards():
    c = Cluster(shards=1, caches=1, engine="torch", shard_args=SHARD_ARGS)
    c.start()
    pp = Service(["shard", "--engine", "torch", "--registry-url", c.registry, "--node-id", "shard-pp",
                  *SHARD_ARGS, "--pipeline-parallel-size", str(STAGES)], ready_timeout=300)
    try:
        pp.start()
        yield c.shards[0], pp
    finally:
        pp.stop()
        c.stop()


def _moved(shard: Service, op: str) -> float:
    return total(shard.url, "switchboard_shard_pipeline_kv_bytes_total", op=op)


def kv_spans(shard: Service, request_id: str, op: str) -> list[dict]:
    """The attributes of the request's `shard.pipeline_kv_<op>` spans (children of its shard.generate)."""
    spans = httpx.get(shard.url + "/debug/spans", headers=CLUSTER_HEADERS).json()
    (gen,) = [s for s in spans if s["name"] == "shard.generate"
              and s["attributes"].get("switchboard.request_id") == request_id]
    ours = [s for s in spans if s["name"] == f"shard.pipeline_kv_{op}" and s["parent_span_id"] == gen["span_id"]]
    assert all(s["trace_id"] == gen["trace_id"] and s["end_ns"] >= s["start_ns"] for s in ours)
    return [s["attributes"] for s in ours]


def kv_span(shard: Service, request_id: str, op: str) -> dict:
    (span,) = kv_spans(shard, request_id, op)
    return span


class Background:
    """A long greedy stream on `shard` while something else runs: its decode passes are in flight
    through the pipeline beside the other request's (the batch queue); closed (aborted) on exit."""

    def __init__(self, shard: Service) -> None:
        self.shard, self.tokens, self.stop = shard, 0, threading.Event()
        self.decoding = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": STORY}], "temperature": 0, "max_tokens": 1500,
                "ignore_eos": True, "stream": True, "cache_salt": uuid.uuid4().hex}
        with httpx.stream("POST", self.shard.url + "/v1/chat/completions", json=body, timeout=300,
                          headers=CLUSTER_HEADERS) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    self.tokens += 1
                    if self.tokens >= 3:
                        self.decoding.set()
                if self.stop.is_set() or line == "data: [DONE]":
                    return

    def __enter__(self) -> Self:
        self.thread.start()
        assert self.decoding.wait(180), "the background stream never started decoding"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(300)


def test_a_pipelined_shard_fetches_a_conversation_it_never_saw(shards: tuple[Service, Service]) -> None:
    plain, pp = shards
    session, salt = fresh()
    t2, _ = two_turns(plain, STORY * 2 + "Be brief.", session, salt)
    scattered = _moved(pp, "scatter")
    r2 = direct(pp, t2, session=session, salt=salt)
    event = span_event(pp, r2["request_id"], "kv_fetch")
    assert event["decision"] == "fetch" and event["result"] == "hit"
    assert event["tokens_fetched"] == cached(r2) >= 4 * BLOCK and event["tokens_cached"] == 0
    # Stages 1 and 2 got their layers of every fetched block: fp32, 25 of 30 layers, 3 KV heads x 16 x 64.
    assert _moved(pp, "scatter") - scattered == PER_BLOCK * cached(r2) // BLOCK
    span = kv_span(pp, r2["request_id"], "scatter")
    assert span["switchboard.kv.blocks"] == cached(r2) // BLOCK
    assert span["switchboard.kv.bytes"] == PER_BLOCK * cached(r2) // BLOCK
    load = kv_span(pp, r2["request_id"], "load")  # the fetched blocks, from the pool into the slot, on every stage
    assert load["switchboard.kv.blocks"] == cached(r2) // BLOCK
    assert load["switchboard.kv.bytes"] == PER_BLOCK * cached(r2) // BLOCK
    assert text(r2) == reference(pp, t2) == reference(plain, t2)


def test_a_plain_shard_fetches_what_a_pipelined_shard_stored(shards: tuple[Service, Service]) -> None:
    plain, pp = shards
    session, salt = fresh()
    gathered = _moved(pp, "gather")
    t2, r1 = two_turns(pp, STORY * 2 + "In one sentence.", session, salt)
    assert _moved(pp, "gather") > gathered  # stages 1 and 2's layers of the turn's blocks came back to stage 0
    span = kv_span(pp, r1["request_id"], "gather")
    assert span["switchboard.kv.bytes"] == PER_BLOCK * span["switchboard.kv.blocks"] > 0
    assert span["switchboard.pipeline.deferred"] is False  # alone: nothing else was in flight
    r2 = direct(plain, t2, session=session, salt=salt)
    event = span_event(plain, r2["request_id"], "kv_fetch")
    assert event["result"] == "hit" and cached(r2) >= 4 * BLOCK
    assert text(r2) == reference(plain, t2)


def test_a_turn_ending_beside_passes_in_flight_still_reaches_the_cache_nodes(shards: tuple[Service, Service]) -> None:
    """The batch queue keeps the other stream's decode plan in flight when the turn's last pass is
    collected: the GATHER goes behind it and the turn's KV reaches the cache nodes all the same."""
    plain, pp = shards
    session, salt = fresh()
    gathered = _moved(pp, "gather")
    with Background(pp) as other:
        t2, r1 = two_turns(pp, STORY * 2 + "Answer as a list.", session, salt)
        during = other.tokens
    assert during > 3 and not other.thread.is_alive()  # it decoded beside the turn, then was closed
    span = kv_span(pp, r1["request_id"], "gather")
    assert span["switchboard.pipeline.deferred"] is True  # sent behind the other stream's pass in flight
    assert span["switchboard.pipeline.blocked_s"] >= 0  # stage 0's own part of it (the rest overlapped)
    assert span["switchboard.kv.bytes"] == PER_BLOCK * span["switchboard.kv.blocks"] > 0
    assert _moved(pp, "gather") - gathered == span["switchboard.kv.bytes"]
    stores = kv_spans(pp, r1["request_id"], "store")  # the turn's blocks kept in the pool on every stage
    assert stores and all(s["switchboard.kv.blocks"] >= 1 for s in stores)
    r2 = direct(plain, t2, session=session, salt=salt)
    event = span_event(plain, r2["request_id"], "kv_fetch")
    assert event["result"] == "hit" and cached(r2) >= 4 * BLOCK
    assert text(r2) == reference(plain, t2) == reference(pp, t2)
