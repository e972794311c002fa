"""KV blocks on the cache nodes, the parts without a model: the wire format, the node's block store
(LRU byte budget, session expiry, links), its HTTP API in process, the engine pool's insert, the
fetch-or-recompute policy and the shard's verification of fetched frames."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from data_plane.cache.kv_store import MemoryKVStore
from data_plane.cache.node import CacheNodeSettings, create_app
from data_plane.kv_wire import (
    BlockHeader,
    KVWireError,
    decode_frame,
    encode_frame,
    encode_put,
    peek_hash,
    split_frames,
)
from data_plane.shard.engines.kv_cache import PrefixCache
from data_plane.shard.kv_tier import FetchPolicy
from tests.support.clock import FakeClock

SHAPE = (2, 2, 1, 4, 8)


def header(h: bytes, dtype: str = "float32") -> BlockHeader:
    return BlockHeader(h, "model-x", dtype, "llama.L2.kvh1.d8.bs4", SHAPE)


def frame(i: int, size: int = 64) -> bytes:
    return encode_frame(header(bytes([i]) * 16), bytes([i % 251]) * size)


def test_frame_round_trip_and_every_way_it_is_refused() -> None:
    f = frame(7)
    h, payload = decode_frame(f)
    assert h == header(bytes([7]) * 16) and bytes(payload) == bytes([7]) * 64
    assert peek_hash(f) == bytes([7]) * 16
    assert [bytes(x) for x in split_frames(f + frame(8))] == [f, frame(8)]
    corrupt = bytearray(f)
    corrupt[-3] ^= 0x10
    with pytest.raises(KVWireError) as err:
        decode_frame(bytes(corrupt))
    assert err.value.reason == "checksum"
    tampered = bytearray(f)
    tampered[50] ^= 1  # inside the header's variable part (shape / names): covered by the checksum
    with pytest.raises(KVWireError) as err:
        decode_frame(bytes(tampered))
    assert err.value.reason in ("checksum", "malformed")
    with pytest.raises(KVWireError) as err:
        decode_frame(f[:-1])
    assert err.value.reason == "malformed"
    assert not header(b"x" * 16, "bfloat16").same_kind(header(b"x" * 16))


def test_store_keeps_its_byte_budget_and_sessions_expire_with_their_blocks() -> None:
    clock = FakeClock(1000.0)
    evicted: dict[str, int] = {}
    size = len(frame(0))
    store = MemoryKVStore(3 * size, on_evict=lambda r, n: evicted.__setitem__(r, evicted.get(r, 0) + n),
                          clock=clock)

    async def go() -> None:
        assert await store.put("s1", [frame(0), frame(1)], [], ttl_s=10) == 2
        # s2 shares block 0 (a common system prompt): linked, not re-sent
        assert await store.put("s2", [frame(2)], [bytes([0]) * 16], ttl_s=100) == 1
        assert [peek_hash(f)[0] for f in await store.fetch([bytes([0]) * 16, bytes([1]) * 16])] == [0, 1]
        assert await store.fetch([bytes([9]) * 16, bytes([0]) * 16]) == []  # the leading run only
        await store.put("s3", [frame(3)], [], ttl_s=100)  # over budget: the least recently used goes
        assert store.stats().bytes <= 3 * size and evicted == {"lru": 1}
        assert await store.fetch([bytes([2]) * 16]) == []  # block 2 was least recently used
        clock.now += 50  # s1 expires; block 0 is still linked by s2, block 1 only by s1
        store.sweep()
        assert [peek_hash(f)[0] for f in await store.fetch([bytes([0]) * 16])] == [0]
        assert await store.fetch([bytes([1]) * 16]) == []
        assert await store.drop_session("s2") == 1 and await store.fetch([bytes([0]) * 16]) == []
        assert store.stats().sessions == 1

    asyncio.run(go())


def test_sessions_whose_blocks_the_lru_took_are_forgotten_so_the_store_stays_bounded() -> None:
    """A full budget and a stream of new sessions (every turn of a long-running node): the LRU takes the
    old sessions' blocks, and the sessions must go with them. They stayed until their TTL (a day): one
    entry per session ever written, held past the byte budget, each counted in `kv_sessions`."""
    size = len(frame(0))
    store = MemoryKVStore(4 * size)

    async def go() -> None:
        for i in range(2_000):  # each session its own block
            await store.put(f"s{i}", [encode_frame(header(i.to_bytes(16, "big")), bytes(64))], [], ttl_s=86_400)
            assert store.stats().blocks <= 4 and store.stats().sessions <= 4, (i, store.stats())
        assert await store.session_blocks("s1999") and await store.session_blocks("s0") == []
        assert await store.put("linked-nothing", [], [bytes([200]) * 16], ttl_s=60) == 0  # no such block
        assert store.stats().sessions <= 4

    asyncio.run(go())


def test_node_http_api_put_fetch_skip_and_session_delete_drops_blocks() -> None:
    app = create_app(CacheNodeSettings(port=1, node_id="cache-t", kv_max_bytes=1 << 20))
    with TestClient(app) as client:
        body = encode_put([], [frame(1), frame(2), frame(3)])
        r = client.put("/v1/kv/sessions/sess-1", content=body, params={"ttl_s": 60})
        assert r.status_code == 200 and r.json() == {"stored": 3, "linked": 0}
        hashes = b"".join(bytes([i]) * 16 for i in (1, 2, 3, 4))
        r = client.post("/v1/kv/fetch", content=hashes, params={"skip": 1})
        assert r.headers["x-kv-run"] == "3"
        assert [peek_hash(f)[0] for f in split_frames(r.content)] == [2, 3]
        assert client.put("/v1/kv/sessions/sess-1", content=b"junk").status_code == 400
        assert client.post("/v1/kv/fetch", content=b"short").status_code == 400
        metrics = client.get("/metrics").text
        assert "switchboard_cache_kv_blocks 3.0" in metrics
        r = client.put("/v1/sessions/sess-1", json={"owner": "o", "messages": [], "version": 1})
        assert r.status_code == 200
        assert client.delete("/v1/sessions/sess-1").status_code == 200  # the transcript and its KV
        assert client.post("/v1/kv/fetch", content=hashes).headers["x-kv-run"] == "0"
        assert 'switchboard_cache_kv_evictions_total{reason="session"} 3.0' in client.get("/metrics").text


def test_pool_insert_serves_exactly_the_inserted_kv() -> None:
    cache = PrefixCache(num_layers=2, kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32,
                        budget_bytes=3 * 2 * 2 * 4 * 8 * 4)
    kv = torch.randn(2, *SHAPE)
    held = cache.insert([b"a" * 16, b"b" * 16], kv)
    assert len(held) == 2 and cache.probe([b"a" * 16, b"b" * 16], 2) == 2
    k = [torch.zeros(1, 1, 8, 8) for _ in range(2)]
    v = [torch.zeros(1, 1, 8, 8) for _ in range(2)]
    cache.load(held, k, v, 0)
    for layer in range(2):
        for j in range(2):
            assert torch.equal(k[layer][0, :, j * 4 : (j + 1) * 4], kv[j, 0, layer])
            assert torch.equal(v[layer][0, :, j * 4 : (j + 1) * 4], kv[j, 1, layer])
    cache.release(held)
    assert cache.insert([b"a" * 16], kv[:1]) == []  # already cached: skipped


def test_policy_learns_and_prices_both_ways() -> None:
    p = FetchPolicy(prior_bytes_per_s=100e6, prior_prefill_tok_s=500)
    fetch_s, prefill_s = p.estimate(160, 160 * 46_000)
    assert fetch_s < prefill_s
    for _ in range(20):  # a slow network, learned
        p.observe_transfer(10 << 20, 10.0)
    fetch_s, prefill_s = p.estimate(160, 160 * 46_000)
    assert fetch_s > prefill_s
    p.observe_prefill(10, 100.0)  # too small a sample: ignored
    assert p.prefill_tok_s == 500


def test_redis_store_keeps_blocks_links_and_session_index(redis_server) -> None:
    from data_plane.cache.kv_store import RedisKVStore

    async def go() -> None:
        store = RedisKVStore(redis_server.url, f"t-{uuid.uuid4().hex[:8]}:")
        await store.start()
        try:
            assert await store.put("s1", [frame(1), frame(2)], [], ttl_s=60) == 2
            await store.put("s2", [frame(3)], [bytes([1]) * 16], ttl_s=60)
            got = await store.fetch([bytes([1]) * 16, bytes([2]) * 16, bytes([9]) * 16, bytes([3]) * 16])
            assert [peek_hash(f)[0] for f in got] == [1, 2]
            assert sorted(h[0] for h in await store.session_blocks("s2")) == [1, 3]
            stats = await store.refresh_stats()
            assert stats.blocks == 3 and stats.sessions == 2 and stats.bytes == 3 * len(frame(1))
            assert await store.drop_session("s1") == 1 and await store.session_blocks("s1") == []
        finally:
            await store.aclose()

    asyncio.run(go())


def test_fetched_frames_of_another_model_dtype_or_hash_are_never_used() -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from data_plane.shard.kv_metrics import KVTierMetrics
    from data_plane.shard.kv_tier import KVTier

    tier = KVTier(None, KVTierMetrics(CollectorRegistry(), "m"))  # type: ignore[arg-type]  # no remote needed
    tier.prefix = SimpleNamespace(model_id="model-x", dtype="float32", layout="llama.L2.kvh1.d8.bs4",
                                  block_shape=SHAPE, torch_dtype=torch.float32)  # type: ignore[assignment]
    kv = torch.randn(3, *SHAPE)
    hashes = [bytes([i]) * 16 for i in range(3)]

    def frames(dtype: str = "float32", model: str = "model-x", swap: bool = False) -> bytes:
        out = []
        for j, h in enumerate(hashes):
            hdr = BlockHeader(hashes[2 - j] if swap else h, model, dtype, "llama.L2.kvh1.d8.bs4", SHAPE)
            out.append(encode_frame(hdr, kv[j].numpy().tobytes()))
        return b"".join(out)

    scopes = [""] * 3
    got, n, reason = tier._verify(frames(), hashes, scopes)
    assert n == 3 and reason is None and torch.equal(got, kv)
    for bad in (frames(dtype="bfloat16"), frames(model="model-y"), frames(swap=True)):
        got, n, reason = tier._verify(bad, hashes, scopes)
        assert (got, n, reason) == (None, 0, "layout")
    mixed = bytearray(frames())
    mixed[-5] ^= 1  # the last block's payload: the first two are still good
    got, n, reason = tier._verify(bytes(mixed), hashes, scopes)
    assert n == 2 and reason == "checksum" and torch.equal(got, kv[:2])


def _relabel(frame: bytes | bytearray, new_hash: bytes) -> bytes:
    """What an attacker on a cache node does to move a frame: rewrite the hash it claims (the
    checksum does not cover it), or re-encode a changed payload with a fresh checksum."""
    out = bytearray(frame)
    out[8:24] = new_hash
    return bytes(out)


def test_sealed_frames_open_only_under_their_hash_scope_and_keys() -> None:
    from prometheus_client import CollectorRegistry

    from data_plane.shard.kv_seal import block_scopes
    from tests.support.kv import kv_tier, ring

    registry = CollectorRegistry()
    keys = ring("k1")
    tier = kv_tier(keys, registry)
    kv = torch.randn(3, *SHAPE)
    hashes = [bytes([i]) * 16 for i in range(3)]
    scopes = ["tenant:a"] * 3
    frames = tier._frames(hashes, kv, scopes)
    body = b"".join(frames)
    for j, f in enumerate(frames):
        h, payload = decode_frame(f)
        assert h.sealed and peek_hash(f) == hashes[j]  # the node still indexes by hash
        assert kv[j].numpy().tobytes()[:64] not in bytes(f)  # no plaintext KV on the wire or at rest
    got, n, reason = tier._verify(body, hashes, scopes)
    assert n == 3 and reason is None and torch.equal(got, kv)

    def rejected(b: bytes, want: int, sc: list[str] = scopes, t=tier) -> None:
        got, n, reason = t._verify(b, hashes, sc)
        assert (n, reason) == (want, "sealed") and (want == 0 or torch.equal(got, kv[:want]))

    rejected(body, 0, ["tenant:b"] * 3)  # another tenant's scope: nothing opens
    rejected(frames[0] + _relabel(frames[2], hashes[1]) + frames[2], 1)  # copied under another hash
    h1, payload = decode_frame(frames[1])
    flipped = bytearray(payload)
    flipped[-40] ^= 1  # tampered ciphertext with a fresh checksum: only the seal catches it
    rejected(frames[0] + encode_frame(h1, bytes(flipped)) + frames[2], 1)
    plain = encode_frame(BlockHeader(hashes[0], "model-x", "float32", h1.layout, SHAPE), kv[0].numpy().tobytes())
    rejected(plain + frames[1], 0)  # a plaintext frame where sealed ones are required
    rejected(body, 0, t=kv_tier(ring("k3")))  # sealed with a key this shard lacks
    rotated = kv_tier(ring("k2", "k1", keys={"k1": keys.keys["k1"]}))  # new key first, old one still listed
    got, n, reason = rotated._verify(body, hashes, scopes)
    assert n == 3 and reason is None and torch.equal(got, kv)
    assert decode_frame(rotated._frames(hashes[:1], kv[:1], scopes)[0])[1][1:3].tobytes() == b"k2"
    text = "\n".join(line for line in __import__("prometheus_client").generate_latest(registry).decode().splitlines()
                     if line.startswith("switchboard_shard_kv_"))
    assert 'switchboard_shard_kv_crypto_total{model_name="m",op="seal",result="ok"} 3.0' in text
    assert 'switchboard_shard_kv_crypto_total{model_name="m",op="open",result="failed"} 3.0' in text
    assert 'switchboard_shard_kv_crypto_total{model_name="m",op="open",result="plaintext"} 1.0' in text
    # scopes follow the hash chain's salting: public blocks are shared (""), the rest the tenant's
    assert block_scopes(4, 4, "t", 8) == ["", "", "t", "t"]
    assert block_scopes(2, 4, None, 0) == ["", ""]


def test_kv_keys_differ_from_transcript_keys() -> None:
    from data_plane.common.crypto import Keyring
    from data_plane.shard.kv_seal import kv_keyring

    assert kv_keyring(keys_file=None, keys_env=None, cluster_token="tok").keys != Keyring.derived("tok").keys
    env = "k1:" + __import__("base64").b64encode(b"x" * 32).decode()
    assert kv_keyring(keys_file=None, keys_env=env, cluster_token="tok").current == "k1"


def test_switchboard_up_gives_every_shard_the_session_keys_file(tmp_path) -> None:
    from control_plane.launcher import UpSettings, plan
    from data_plane.common.settings_cli import parse_settings
    from data_plane.shard.settings import ShardSettings

    keys = str(tmp_path / "session_keys")
    _, _, shards, gateways = plan(UpSettings(shards=2, engine="synthetic"), tmp_path, "admin", "cluster")
    Path(keys).touch()  # `switchboard up` writes it before it starts a shard (the parser checks it is there)
    for shard in shards:  # the shard's own parser reads it (and sealing is on by default)
        settings = parse_settings(ShardSettings, shard.args[1:], "switchboard shard")
        assert settings.kv_keys_file == keys and settings.kv_seal == "on"
    assert all(keys in g.args for g in gateways)
    cp, *_ = plan(UpSettings(autoscale=True, engine="synthetic"), tmp_path, "admin", "cluster")
    assert f"--kv-keys-file {keys}" in " ".join(cp.args)  # shards the autoscaler starts too
