"""The KV tier through a pipeline (data_plane/shard/engines/pipeline.py Hops.gather / insert), with
real processes and the real model (float32, greedy): a cache node, a plain shard and a 2-stage
pipelined shard. Blocks are whole on the cache nodes whichever kind of shard made them, so:

- a conversation stored by the plain shard is fetched by the pipelined shard, which has never seen
  it (stage 0 scatters each stage its layers of the fetched blocks): its next turn is served from
  the fetched KV and answers exactly what computing it does;
- a conversation stored by the pipelined shard (stage 0 gathers the later stage's layers) is
  fetched by the plain shard: the same.
"""

from __future__ import annotations

import pytest

from tests.data_plane.test_kv_tier import (
    BLOCK,
    STORY,
    cached,
    direct,
    fresh,
    reference,
    span_event,
    text,
    total,
    two_turns,
)
from tests.support.cluster import Cluster
from tests.support.procs import Service

pytestmark = pytest.mark.slow

SHARD_ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--speculation", "off"]


@pytest.fixture(scope="module")
def shards():
    c = Cluster(shards=1, caches=1, engine="torch", shard_args=SHARD_ARGS)
    c.start()
    pp = Service(["shard", "--engine", "torch", "--registry-url", c.registry, "--node-id", "shard-pp",
                  *SHARD_ARGS, "--pipeline-parallel-size", "2"], ready_timeout=300)
    try:
        pp.start()
        yield c.shards[0], pp
    finally:
        pp.stop()
        c.stop()


def _moved(shard: Service, op: str) -> float:
    return total(shard.url, "switchboard_shard_pipeline_kv_bytes_total", op=op)


def test_a_pipelined_shard_fetches_a_conversation_it_never_saw(shards: tuple[Service, Service]) -> None:
    plain, pp = shards
    session, salt = fresh()
    t2, _ = two_turns(plain, STORY * 2 + "Be brief.", session, salt)
    scattered = _moved(pp, "scatter")
    r2 = direct(pp, t2, session=session, salt=salt)
    event = span_event(pp, r2["request_id"], "kv_fetch")
    assert event["decision"] == "fetch" and event["result"] == "hit"
    assert event["tokens_fetched"] == cached(r2) >= 4 * BLOCK and event["tokens_cached"] == 0
    # Stage 1's half of every fetched block went to it: fp32, 15 of 30 layers, 3 KV heads x 16 x 64.
    per_block = 2 * 15 * 3 * BLOCK * 64 * 4
    assert _moved(pp, "scatter") - scattered == per_block * cached(r2) // BLOCK
    assert text(r2) == reference(pp, t2) == reference(plain, t2)


def test_a_plain_shard_fetches_what_a_pipelined_shard_stored(shards: tuple[Service, Service]) -> None:
    plain, pp = shards
    session, salt = fresh()
    gathered = _moved(pp, "gather")
    t2, _ = two_turns(pp, STORY * 2 + "In one sentence.", session, salt)
    assert _moved(pp, "gather") > gathered  # stage 1's layers of the turn's blocks came back to stage 0
    r2 = direct(plain, t2, session=session, salt=salt)
    event = span_event(plain, r2["request_id"], "kv_fetch")
    assert event["result"] == "hit" and cached(r2) >= 4 * BLOCK
    assert text(r2) == reference(plain, t2)
