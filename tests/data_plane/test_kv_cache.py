"""The prefix cache's pool and hash chain on small tensors (no model): addressing, isolation,
references, LRU eviction, and that a reused block never serves stale KV."""

from __future__ import annotations

import pytest
import torch

from data_plane.shard.engines.kv_cache import (
    EVICT_CAPACITY,
    EVICT_NO_SPACE,
    BlockHasher,
    CacheEvents,
    PrefixCache,
    layout_seed,
)
from tests.support.clock import FakeClock

BS = 4


def hasher(model: str = "m", dtype: str = "float32") -> BlockHasher:
    return BlockHasher(layout_seed(model, dtype, "L2.kvh1.d2.bs4"), BS)


def test_chain_is_stable_full_blocks_only_and_seeded() -> None:
    h = hasher()
    ids = list(range(10))
    a = h.hashes(ids)
    assert len(a) == 2 and a == h.hashes(ids)                # deterministic (never Python's hash())
    assert h.hashes(ids[:8]) == a and h.hashes(ids[:4]) == a[:1]
    assert h.hashes([0, 1, 2, 9, 4, 5, 6, 7])[1] != a[1]    # a change in block 0 changes every later digest
    assert hasher(model="other").hashes(ids) != a
    assert hasher(dtype="bfloat16").hashes(ids) != a


def test_salt_isolates_tenants_except_the_public_prefix() -> None:
    h = hasher()
    ids = list(range(12))
    acme, globex = h.hashes(ids, salt="acme"), h.hashes(ids, salt="globex")
    assert not set(acme) & set(globex) and not set(acme) & set(h.hashes(ids))
    # The first 8 tokens are a public system prompt: those two blocks are shared, the rest are not.
    pa, pg = h.hashes(ids, "acme", public_tokens=8), h.hashes(ids, "globex", public_tokens=8)
    assert pa[:2] == pg[:2] == h.hashes(ids)[:2] and pa[2] != pg[2]
    # A public prefix that ends mid-block: that block is salted.
    assert h.hashes(ids, "acme", public_tokens=6)[1] != h.hashes(ids, "globex", public_tokens=6)[1]


def cache(blocks: int) -> tuple[PrefixCache, list[torch.Tensor], list[torch.Tensor]]:
    pc = PrefixCache(num_layers=2, kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32,
                     budget_bytes=blocks * 2 * 2 * 1 * BS * 2 * 4)
    k = [torch.zeros(2, 1, 32, 2) for _ in range(2)]
    v = [torch.zeros(2, 1, 32, 2) for _ in range(2)]
    return pc, k, v


def fill(k: list[torch.Tensor], v: list[torch.Tensor], slot: int, ids: list[int]) -> None:
    """Fake KV that is a function of (token, position, layer): a stale block would show."""
    for layer in range(2):
        for pos, t in enumerate(ids):
            k[layer][slot, 0, pos] = torch.tensor([t, pos + 100 * layer])
            v[layer][slot, 0, pos] = torch.tensor([-t, pos])


def test_store_probe_load_round_trip() -> None:
    pc, k, v = cache(8)
    h = hasher()
    ids = list(range(50, 62))
    fill(k, v, 0, ids)
    hashes = h.hashes(ids)
    assert pc.store(hashes, k, v, 0) and pc.used_blocks == 3
    assert pc.probe(hashes, 10) == 3 and pc.probe(hashes, 2) == 2 and pc.probe(h.hashes([1] * 12), 3) == 0
    held = pc.acquire(hashes[:3])
    pc.load(held, k, v, 1)
    for layer in range(2):
        assert torch.equal(k[layer][1, :, :12], k[layer][0, :, :12])
        assert torch.equal(v[layer][1, :, :12], v[layer][0, :, :12])
    pc.release(held)


def test_referenced_blocks_are_never_evicted_and_lru_goes_first() -> None:
    pc, k, v = cache(4)
    h = hasher()
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    for ids in (a, b):
        fill(k, v, 0, ids)
        pc.store(h.hashes(ids), k, v, 0)
    held = pc.acquire(h.hashes(a))          # a is in use
    fill(k, v, 0, c)
    pc.store(h.hashes(c), k, v, 0)          # needs 2 blocks: b (unreferenced) goes, a stays
    assert pc.probe(h.hashes(a), 2) == 2 and pc.probe(h.hashes(b), 2) == 0 and pc.probe(h.hashes(c), 2) == 2
    assert pc.evictions[EVICT_CAPACITY] == 2
    pc.acquire(h.hashes(c))
    d = list(range(300, 308))
    fill(k, v, 0, d)
    assert pc.store(h.hashes(d), k, v, 0) == []   # everything referenced: not stored, counted
    assert pc.evictions[EVICT_NO_SPACE] == 2 and pc.probe(h.hashes(a), 2) == 2
    pc.release(held)


def test_eviction_under_a_tiny_budget_never_serves_a_stale_block() -> None:
    pc, k, v = cache(3)
    h = hasher()
    prompts = [[(p * 7 + i) % 97 for i in range(12)] for p in range(40)]
    for rnd in range(3):
        for p in prompts:
            hashes = h.hashes(p)
            n = pc.probe(hashes, 3)
            held = pc.acquire(hashes[:n])
            pc.load(held, k, v, 1)
            fill(k, v, 0, p)
            for layer in range(2):   # whatever came from the cache is exactly this prompt's KV
                assert torch.equal(k[layer][1, :, : n * BS], k[layer][0, :, : n * BS])
                assert torch.equal(v[layer][1, :, : n * BS], v[layer][0, :, : n * BS])
            pc.store(hashes, k, v, 0, n)
            pc.release(held)
    assert pc.evictions[EVICT_CAPACITY] > 0 and pc.used_blocks <= 3


def test_block_residency_is_reported_on_reuse_and_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    """What feeds vllm:kv_block_{lifetime,idle_before_evict,reuse_gap}_seconds."""
    from data_plane.shard.engines import kv_cache

    clock = FakeClock(100.0)
    monkeypatch.setattr(kv_cache.time, "monotonic", clock)
    evicted: list[tuple[float, float]] = []
    reused: list[float] = []
    pc, k, v = cache(2)
    pc.events = CacheEvents(on_block_evicted=lambda life, idle: evicted.append((life, idle)),
                            on_block_reused=reused.append)
    h = hasher()
    a, b = list(range(8)), list(range(20, 28))
    fill(k, v, 0, a)
    pc.store(h.hashes(a), k, v, 0)        # 2 blocks stored at t=100
    clock.now = 103.0
    pc.release(pc.acquire(h.hashes(a)[:1]))  # block 0 used again after 3 s
    assert reused == [3.0]
    clock.now = 110.0
    fill(k, v, 0, b)
    pc.store(h.hashes(b), k, v, 0)        # evicts both: block 1 (idle since 100), then block 0 (used at 103)
    assert evicted == [(10.0, 10.0), (10.0, 7.0)]
