"""A shard's prefix-cache reports to routers (data_plane/shard/kv_reports.py): the chain id of each
prompt, and the announced chains it has since evicted, read by the router's index (and, slow: through
real processes, a real shard's eviction makes the gateway forget the session's holder)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.kv_report import CHAIN_HEADER, EVICTED_HEADER, parse_chain, parse_evicted
from data_plane.routing.kv_routing import KVIndex
from data_plane.routing.kv_routing import KVReports as RouterReports
from data_plane.shard.engines.base import GenerationRequest, SamplingParams
from data_plane.shard.kv_reports import KVReportMetrics, KVReports
from tests.support.clock import FakeClock


class Cache:
    def __init__(self) -> None:
        self.held: set[bytes] = set()

    def probe(self, hashes: list[bytes], max_blocks: int) -> int:
        return 1 if hashes[0] in self.held else 0


class Prefix:
    """Block 'digests' are the prompt's token ids in 16-token groups (enough for the reports)."""

    def __init__(self) -> None:
        self.cache = Cache()

    def hashes(self, ids: list[int], salt: str | None, public: int) -> list[bytes]:
        return [bytes(f"{salt}|{ids[: i + 16]}", "ascii").ljust(16, b"-")[-16:] for i in range(0, len(ids) - 15, 16)]


def request(n: int, first: int = 0) -> GenerationRequest:
    return GenerationRequest("r", list(range(first, first + n)), SamplingParams(), cache_salt="tenant:a")


def test_an_announced_chain_is_reported_once_evicted_and_read_by_the_router() -> None:
    prefix, clock, registry = Prefix(), FakeClock(), CollectorRegistry()
    shard = KVReports(lambda: prefix, clock=clock, on_evicted=KVReportMetrics(registry, "m").counting())
    req = request(40)
    assert shard.headers(req, None) == {}    # not a kv_aware router: nothing computed, nothing sent
    out = shard.headers(req, "0")
    chain = parse_chain(out[CHAIN_HEADER])
    assert chain is not None and chain[1] == 40 and EVICTED_HEADER not in out
    digest = prefix.hashes(req.prompt_ids, "tenant:a", 0)[-1]
    index = KVIndex()
    index.record("s-1", "shard-a", 40, chain[0])
    router = RouterReports(index)
    prefix.cache.held.add(digest)            # prefilled: the prompt's blocks are cached
    clock.now += 1
    assert EVICTED_HEADER not in shard.headers(request(20, 1000), "0")
    prefix.cache.held.clear()                # evicted (LRU)
    clock.now += 1
    out = shard.headers(request(20, 2000), "0")
    assert parse_evicted(out[EVICTED_HEADER]) == (1, [chain[0]])
    assert router.read("shard-a", lambda name: out.get(name.decode(), "").encode() or None) == 1
    assert index.holder("s-1") is None
    clock.now += 1
    assert EVICTED_HEADER not in shard.headers(request(20, 3000), "1")   # nothing new since 1
    assert registry.get_sample_value("switchboard_shard_kv_evictions_reported_total", {"model_name": "m"}) == 1


def test_reports_stay_bounded_and_a_never_cached_chain_is_dropped_silently() -> None:
    prefix, clock = Prefix(), FakeClock()
    shard = KVReports(lambda: prefix, clock=clock, max_announced=5, unseen_ttl_s=10)
    for i in range(20):
        shard.headers(request(32, 100 * i), "0")
    assert len(shard._announced) == 5
    clock.now += 11
    shard.headers(request(8), "0")           # too short for a full block: no chain
    assert len(shard._announced) == 0 and shard.since(0) == []
    assert KVReports(lambda: None).headers(request(32), "0") == {}   # no prefix cache: no headers


@pytest.mark.slow
def test_a_real_shard_reports_an_evicted_session_prefix_and_the_gateway_forgets_it() -> None:
    """Real processes: a bf16 shard whose prefix cache holds 12 blocks; a session's prompt is evicted
    by other prompts, and the next response carries the report the gateway's kv_aware index reads."""
    import time

    import httpx

    from tests.support.cluster import Cluster
    from tests.support.metrics import metric

    block_bytes = 2 * 30 * 3 * 16 * 64 * 2   # SmolLM2-135M, bf16: one 16-token block of K and V
    with Cluster(shards=1, caches=1, engine="torch", shard_args=[
            "--dtype", "bfloat16", "--prefix-cache-bytes", str(12 * block_bytes), "--speculation", "off"],
            gateway_args=["--routing-policy", "kv_aware"]) as c:
        url = c.gateway.url + "/v1/chat/completions"
        auth = {"authorization": f"Bearer {c.keys['plus']}"}

        def ask(words: str, session: str | None = None) -> httpx.Response:
            headers = {**auth, **({"x-session-id": session} if session else {})}
            r = httpx.post(url, headers=headers, timeout=120,
                           json={"messages": [{"role": "user", "content": words}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r

        ask("Tell me about rivers and the mountains they come from, briefly. " * 3, "new")
        for i in range(3):   # other prompts fill the 12 blocks: the session's prefix is evicted
            time.sleep(0.6)  # the shard checks its announced prefixes at most every 0.5 s
            ask(f"Unrelated question number {i}: " + "lantern orchard bridge village candle " * 12)
        shard = c.shards[0].url
        assert metric(shard, "switchboard_shard_kv_evictions_reported_total") >= 1
        assert metric(c.gateway.url, "switchboard_router_kv_forgotten_total") == 1
