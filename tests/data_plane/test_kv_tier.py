"""KV blocks on the cache nodes, with real processes and the real model (float32, greedy):

- the session's shard is killed: the next turn, on the other shard, fetches the conversation's KV
  from the cache nodes (metrics and span events say fetched, not computed) and its output is the
  same as a full recompute;
- a corrupted stored block is never used (counted, recomputed, same output);
- the cache nodes hold only sealed frames (the conversation's KV, opened with the cluster's keys,
  appears nowhere in what they store), and a frame tampered on a node with a valid checksum does not
  open: counted as sealed, recomputed, same output;
- another tenant's identical prompt (even under the same session id) gets no hit;
- a small cache-node budget evicts all the time and never serves a stale block;
- cache nodes down: the turn recomputes and answers 200.

One cluster for the module (control plane, two cache nodes with a small KV budget, two fp32
shards, a gateway); each shard process loads the model once. The last test kills the cache nodes.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.support.chat import chat
from tests.support.cluster import Cluster
from tests.support.formats import INVARIANT_ARGS
from tests.support.kv_turns import (
    BLOCK,
    MAX_TOKENS,
    STORY,
    cached,
    direct,
    fresh,
    reference,
    span_event,
    text,
    total,
    two_turns,
    wait_offloaded,
)
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, CLUSTER_TOKEN, Service
from tests.support.waits import eventually

pytestmark = pytest.mark.slow

FRAME_BYTES = 2 * 30 * 3 * BLOCK * 64 * 4 + 128 + 64  # one fp32 SmolLM2 block on the wire: header, seal
KV_BUDGET_BLOCKS = 48
SALT = "tenant:acme"  # what the gateway sends for the test keys' tenant


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(shards=2, caches=2, engine="torch",
                shard_args=[*INVARIANT_ARGS, "--max-num-seqs", "4", "--speculation", "off"])
    for cache in c.caches:
        cache.env["SWITCHBOARD_CACHE_KV_MAX_BYTES"] = str(KV_BUDGET_BLOCKS * FRAME_BYTES)
    c.start()
    yield c
    c.stop()


def test_killed_shard_next_turn_fetches_kv_from_the_cache_nodes(cluster: Cluster) -> None:
    gw = cluster.gateway.url
    done = {s.url: total(s.url, "vllm:request_success_total", finished_reason="length")
            + total(s.url, "vllm:request_success_total", finished_reason="stop") for s in cluster.shards}
    r1 = chat(gw, "plus", STORY * 3, headers={"X-Session-Id": "new"}, temperature=0, max_tokens=MAX_TOKENS,
              timeout=300)
    assert r1.status_code == 200, r1.text
    session = r1.headers["x-session-id"]
    owner = next(s for s in cluster.shards if total(s.url, "vllm:request_success_total", finished_reason="length")
                 + total(s.url, "vllm:request_success_total", finished_reason="stop") > done[s.url])
    other = next(s for s in cluster.shards if s is not owner)
    wait_offloaded(owner, 0)
    assert sum(total(c.url, "switchboard_cache_kv_blocks") for c in cluster.caches) > 0
    owner.kill()
    cluster.wait_members(1, 2)

    before = {n: total(other.url, n) for n in ("vllm:external_prefix_cache_hits_total",
                                                 "vllm:external_prefix_cache_queries_total")}
    fetch_decisions = total(other.url, "switchboard_shard_kv_fetch_decisions_total", decision="fetch")
    r2 = chat(gw, "plus", "And when going downhill?", headers={"X-Session-Id": session}, temperature=0,
              max_tokens=MAX_TOKENS, timeout=300)
    assert r2.status_code == 200, r2.text
    fetched = total(other.url, "vllm:external_prefix_cache_hits_total") - before["vllm:external_prefix_cache_hits_total"]
    assert fetched >= 4 * BLOCK  # the conversation's prefix came from the cache nodes
    assert total(other.url, "switchboard_shard_kv_fetch_decisions_total", decision="fetch") == fetch_decisions + 1
    usage = r2.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == fetched  # served, not computed
    assert total(other.url, "switchboard_shard_kv_blocks_rejected_total", reason="checksum") == 0
    # The same turn recomputed from scratch on the survivor gives the same greedy text.
    messages = [{"role": "user", "content": STORY * 3},
                {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And when going downhill?"}]
    assert r2.json()["choices"][0]["message"]["content"] == reference(other, messages)
    cluster.survivor = other  # type: ignore[attr-defined]


def test_fetched_turn_span_events_say_fetched_not_computed(cluster: Cluster) -> None:
    a = cluster.survivor  # type: ignore[attr-defined]
    # A second shard again, so blocks can cross between shards for the remaining tests.
    b = Service(["shard", "--engine", "torch", "--registry-url", cluster.registry, "--node-id", "shard-b",
                 *INVARIANT_ARGS, "--max-num-seqs", "4", "--speculation", "off"], ready_timeout=180).start()
    cluster.other = b  # type: ignore[attr-defined]
    cluster.extra = [b]  # type: ignore[attr-defined]
    session, salt = fresh()
    t2, _ = two_turns(a, STORY * 2 + "Be brief.", session, salt)
    r2 = direct(b, t2, session=session, salt=salt)
    event = span_event(b, r2["request_id"], "kv_fetch")
    assert event["decision"] == "fetch" and event["result"] == "hit"
    assert event["tokens_fetched"] == cached(r2) >= 4 * BLOCK and event["tokens_cached"] == 0
    prefix = span_event(b, r2["request_id"], "prefix_cache")
    assert prefix["tokens_cached"] == event["tokens_fetched"]
    assert prefix["tokens_computed"] == r2["usage"]["prompt_tokens"] - cached(r2)
    assert text(r2) == reference(b, t2)


def test_corrupt_block_is_recomputed_and_counted(cluster: Cluster) -> None:
    a, b = cluster.survivor, cluster.other  # type: ignore[attr-defined]
    session, salt = fresh()
    t2, _ = two_turns(a, STORY * 2 + "Answer as a mechanic.", session, salt)
    corrupted = 0
    for node in cluster.caches:  # flip one byte of the third block's payload on every replica
        hashes = httpx.get(f"{node.url}/v1/kv/sessions/{session}", headers=CLUSTER_HEADERS).json()["blocks"]
        if len(hashes) < 3:
            continue
        r = httpx.post(f"{node.url}/v1/kv/fetch", content=b"".join(bytes.fromhex(h) for h in hashes[2:3]),
                       headers=CLUSTER_HEADERS)
        frame = bytearray(r.content)
        frame[-100] ^= 0x40
        body = (b"SBKL" + (0).to_bytes(4, "little")) + bytes(frame)
        assert httpx.put(f"{node.url}/v1/kv/sessions/{session}", content=body, headers=CLUSTER_HEADERS,
                         params={"ttl_s": 600}).status_code == 200
        corrupted += 1
    assert corrupted
    rejected = total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason="checksum")
    r2 = direct(b, t2, session=session, salt=salt)
    assert total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason="checksum") == rejected + 1
    assert cached(r2) == 2 * BLOCK  # the two good blocks before it; the rest recomputed
    assert text(r2) == reference(b, t2)


def test_nodes_hold_only_sealed_kv_and_a_tampered_frame_is_recomputed(cluster: Cluster) -> None:
    from prometheus_client import CollectorRegistry

    from data_plane.kv_wire import decode_frame, encode_frame, split_frames
    from data_plane.shard.kv_metrics import KVTierMetrics
    from data_plane.shard.kv_seal import KVSealer, kv_keyring

    a, b = cluster.survivor, cluster.other  # type: ignore[attr-defined]
    session, salt = fresh()
    t2, _ = two_turns(a, STORY * 2 + "Answer as a teacher.", session, salt)
    opener = KVSealer(kv_keyring(keys_file=None, keys_env=None, cluster_token=CLUSTER_TOKEN),
                      KVTierMetrics(CollectorRegistry(), "test"))  # the keys every shard of this cluster derives
    tampered = 0
    for node in cluster.caches:
        hashes = httpx.get(f"{node.url}/v1/kv/sessions/{session}", headers=CLUSTER_HEADERS).json()["blocks"]
        if len(hashes) < 3:
            continue
        stored = httpx.post(f"{node.url}/v1/kv/fetch", content=b"".join(bytes.fromhex(h) for h in hashes),
                            headers=CLUSTER_HEADERS).content  # exactly the bytes the node keeps
        frames = list(split_frames(stored))
        assert len(frames) == len(hashes)
        for frame in frames:
            header, payload = decode_frame(frame)
            assert header.sealed
            plain = bytearray(4 * header.shape[0] * header.shape[1] * header.shape[2] * header.shape[3]
                              * header.shape[4])
            opener.open_into(header, payload, salt, memoryview(plain))  # the conversation's real KV (fp32)
            assert any(plain) and bytes(plain[:4096]) not in stored and bytes(plain[-4096:]) not in stored
        # An attacker on the node flips a ciphertext byte of the third block and fixes the checksum.
        header, payload = decode_frame(frames[2])
        forged = bytearray(payload)
        forged[-100] ^= 0x40
        body = (b"SBKL" + (0).to_bytes(4, "little")) + encode_frame(header, bytes(forged))
        assert httpx.put(f"{node.url}/v1/kv/sessions/{session}", content=body, headers=CLUSTER_HEADERS,
                         params={"ttl_s": 600}).status_code == 200
        tampered += 1
    assert tampered
    before = {r: total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason=r) for r in ("checksum", "sealed")}
    r2 = direct(b, t2, session=session, salt=salt)
    assert total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason="sealed") == before["sealed"] + 1
    assert total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason="checksum") == before["checksum"]
    assert total(b.url, "switchboard_shard_kv_crypto_total", op="open", result="failed") >= 1
    assert cached(r2) == 2 * BLOCK  # the two good blocks before it; the rest recomputed
    assert text(r2) == reference(b, t2)


def test_another_tenants_identical_prompt_gets_no_hit(cluster: Cluster) -> None:
    a, b = cluster.survivor, cluster.other  # type: ignore[attr-defined]
    session, salt = fresh()
    t2, _ = two_turns(a, STORY * 2 + "One paragraph.", session, salt)
    hits = total(b.url, "vllm:external_prefix_cache_hits_total")
    r = direct(b, t2, session=session, salt="tenant:" + uuid.uuid4().hex)  # same session id, same prompt, other tenant
    assert cached(r) == 0
    assert total(b.url, "vllm:external_prefix_cache_hits_total") == hits


def test_small_budget_evicts_and_never_serves_a_stale_block(cluster: Cluster) -> None:
    a, b = cluster.survivor, cluster.other  # type: ignore[attr-defined]
    evictions = sum(total(c.url, "switchboard_cache_kv_evictions_total", reason="lru") for c in cluster.caches)
    turns = []
    for i in range(5):  # ~11 blocks each on two replicas of a 48-block budget: older ones get evicted
        session, salt = fresh()
        t2, _ = two_turns(a, f"Question {i}: " + STORY * 3, session, salt)
        turns.append((session, salt, t2))
    assert sum(total(c.url, "switchboard_cache_kv_evictions_total", reason="lru")
               for c in cluster.caches) > evictions
    rejected = sum(total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason=r) for r in
                   ("checksum", "layout", "malformed", "sealed"))
    fetched_any = False
    for session, salt, t2 in turns:
        r2 = direct(b, t2, session=session, salt=salt)
        fetched_any |= cached(r2) > 0
        assert text(r2) == reference(b, t2)
    assert fetched_any
    assert sum(total(b.url, "switchboard_shard_kv_blocks_rejected_total", reason=r) for r in
               ("checksum", "layout", "malformed", "sealed")) == rejected


def test_cache_nodes_down_means_recompute_not_an_error(cluster: Cluster) -> None:
    a, b = cluster.survivor, cluster.other  # type: ignore[attr-defined]
    session, salt = fresh()
    t2, _ = two_turns(a, STORY + "Short answer.", session, salt)
    def down() -> float:
        return (total(b.url, "switchboard_shard_kv_fetches_total", result="unavailable")
                + total(b.url, "switchboard_shard_kv_fetch_decisions_total", decision="no_cache_nodes"))

    before = down()
    for node in cluster.caches:
        node.kill()
    r2 = direct(b, t2, session=session, salt=salt)  # connection refused (or already out of membership)
    assert cached(r2) == 0 and text(r2) == reference(b, t2)
    assert down() == before + 1
    # membership drops them (their TTL runs out): no cache node to ask at all. Awaited on the gateway's view,
    # which follows the registry as the shard's does, rather than a 3 s sleep a loaded machine may outlast
    eventually(lambda: metric(cluster.gateway.url, "switchboard_gateway_members", service="cache") == 0, 60,
               what="membership without the killed cache nodes")
    none_known = total(b.url, "switchboard_shard_kv_fetch_decisions_total", decision="no_cache_nodes")
    r3 = direct(b, t2 + [{"role": "assistant", "content": text(r2)}, {"role": "user", "content": "Thanks."}],
                session=session, salt=salt)
    assert r3["choices"][0]["message"]["content"] is not None
    assert total(b.url, "switchboard_shard_kv_fetch_decisions_total", decision="no_cache_nodes") == none_known + 1
    for extra in getattr(cluster, "extra", []):
        extra.stop()
