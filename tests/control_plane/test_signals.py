"""Signals: the percentile math, then both readers against a real cluster on loopback."""

from __future__ import annotations

import asyncio
import math
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from control_plane.signals.model import (
    Signals,
    histogram_quantile,
    parse_exposition,
)
from control_plane.signals.prometheus import PrometheusSignals
from control_plane.signals.scrape import ScrapeSignals
from data_plane.membership.view import Member
from tests.support.clock import FakeClock
from tests.support.cluster import Cluster
from tests.support.procs import METRICS_HEADERS, Service, free_port
from tests.support.prometheus import PROMETHEUS, Prometheus
from tests.support.waits import eventually

# -- math ----------------------------------------------------------------------------------------


def test_histogram_quantile_matches_promql() -> None:
    # 100 observations: 50 <= 0.1, 90 <= 0.5, 100 <= 1.0
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.75)  # halfway through (0.5, 1.0]
    assert histogram_quantile(0.95, {0.1: 0.0, math.inf: 0.0}) is None  # no observations: unknown
    assert histogram_quantile(0.95, {0.1: 1.0, 1.0: 1.0, math.inf: 10.0}) == 1.0  # in +Inf: top bound


def test_parse_exposition_keeps_names_and_labels() -> None:
    text = (
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 3.0\n'
        "# TYPE switchboard_gateway_requests counter\n"
        'switchboard_gateway_requests_total{code="ok",status="200",tier="free"} 7.0\n'
    )
    samples = parse_exposition(text)
    assert ("vllm:num_requests_waiting", (("model_name", "m"),), 3.0) in samples
    assert (
        "switchboard_gateway_requests_total",
        (("code", "ok"), ("status", "200"), ("tier", "free")),
        7.0,
    ) in samples


async def test_rates_survive_a_counter_reset_and_critical_members_do_not_poison_the_means() -> None:
    """Canned /metrics at the transport boundary, a fake clock: exact window arithmetic."""
    clock = FakeClock(0.0)
    gateway_total = [100.0]

    def shard_metrics(waiting: float) -> str:
        return (
            'vllm:num_requests_running{model_name="m"} 2\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\nswitchboard_shard_max_num_seqs{model_name="m"} 4\n'
        )

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 9000:
            return httpx.Response(
                200,
                text=(
                    'switchboard_gateway_requests_total{code="ok",status="200",tier="plus"} '
                    f"{gateway_total[0]}\n"
                    'switchboard_admission_queue_depth{tier="plus"} 4\n'
                ),
            )
        return httpx.Response(200, text=shard_metrics(3.0))

    members = [
        Member("shard-a", "shard", "http://127.0.0.1:9001"),
        Member("shard-b", "shard", "http://127.0.0.1:9002", status="critical"),
        Member("gw", "gateway", "http://127.0.0.1:9000"),
    ]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        source = ScrapeSignals(
            lambda s: [m for m in members if m.service == s],
            http,
            window_s=10,
            min_interval_s=0,
            clock=clock,
        )
        first = await source.read()
        assert not first.complete and first.missing == ("history: one scrape so far, no rates yet",)
        clock.now, gateway_total[0] = 5.0, 150.0
        second = await source.read()
        clock.now, gateway_total[0] = 10.0, 20.0  # the gateway restarted: 20 since, not -130
        third = await source.read()
    assert second.complete and second.demand_by_tier == {"plus": pytest.approx(10.0)}
    assert third.demand_by_tier == {"plus": pytest.approx((50 + 20) / 10)}
    assert third.healthy_shards == 1
    assert third.waiting_per_shard == pytest.approx(3.0 + 4.0)  # shard queue + gateway admission queue
    assert third.load_per_shard == pytest.approx(2 + 3 + 4) and third.capacity_per_shard == 4
    b = next(s for s in third.shards if s.member_id == "shard-b")
    assert b.stale and b.error == "member critical (heartbeat missed)" and math.isnan(b.waiting)


async def test_a_shard_without_the_overload_histograms_makes_the_signals_incomplete() -> None:
    """A shard that finishes requests but exports no queue-time histogram (renamed, another engine)
    would leave queue time silently unknown: the reading is incomplete instead, and names why."""
    gauges = ('vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting{model_name="m"} 0\n'
              'vllm:kv_cache_usage_perc{model_name="m"} 0.1\nswitchboard_shard_max_num_seqs{model_name="m"} 4\n')
    histogram = 'vllm:{}_bucket{{le="+Inf",model_name="m"}} 3\n'
    exports = {"full": gauges + "".join(histogram.format(n) for n in (
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds")),
        "renamed": gauges + "".join(histogram.format(n) for n in (
            "e2e_request_latency_seconds", "request_queueing_seconds", "request_prefill_time_seconds"))}
    for case, text in exports.items():
        def handler(request: httpx.Request, text: str = text) -> httpx.Response:
            return httpx.Response(200, text=text)

        members = [Member("shard-a", "shard", "http://127.0.0.1:9001")]
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            source = ScrapeSignals(lambda s, members=members: [m for m in members if m.service == s], http,
                                   min_interval_s=0)
            await source.read()
            s = await source.read()
        if case == "full":
            assert s.complete and s.batch_usage == 0.25, s.missing
        else:
            assert not s.complete and s.waiting_per_shard is None
            assert any("exports no vllm:request_queue_time_seconds" in m for m in s.missing), s.missing


# -- against real processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    # shard-1 heartbeats with a long TTL so that, frozen, it stays "passing" while its scrape fails
    c = Cluster(shards=2, caches=1, token_delay_ms=20)
    c.shards[1].args[-2:-2] = ["--registration-ttl-s", "30"]
    with c:
        yield c


class _RegistryMembers:
    """The cluster's members as the control plane's Registry would list them (read over HTTP)."""

    def __init__(self, registry_url: str, http: httpx.AsyncClient) -> None:
        self.url, self.http = registry_url, http
        self.members: list[Member] = []

    async def refresh(self) -> None:
        body = (await self.http.get(self.url + "/v1/registry/members")).json()
        self.members = [Member.from_dict(d) for d in body["members"]]

    def __call__(self, service: str) -> list[Member]:
        return [m for m in self.members if m.service == service]


async def _chat_load(c: Cluster, http: httpx.AsyncClient, n: int, tier: str = "plus") -> list[int]:
    async def one() -> int:
        r = await http.post(
            c.gateway.url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {c.keys[tier]}"},
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 20},
        )
        return r.status_code

    return await asyncio.gather(*(one() for _ in range(n)))


async def test_scrape_signals_from_a_live_cluster(cluster: Cluster) -> None:
    async with httpx.AsyncClient() as http:
        members = _RegistryMembers(cluster.registry, http)
        await members.refresh()
        source = ScrapeSignals(members, http, window_s=20, min_interval_s=0, headers=METRICS_HEADERS)
        idle = await source.read()
        load = asyncio.create_task(_chat_load(cluster, http, 40))
        await asyncio.sleep(0.3)
        busy = await source.read()
        statuses = await load
        after = await source.read()
        assert statuses == [200] * 40

        assert idle.healthy_shards == 2 and idle.waiting_per_shard == 0.0  # known zero, not unknown
        assert {s.member_id for s in busy.shards} == {"shard-0", "shard-1"}
        assert sum(s.running for s in busy.shards) > 0 and busy.load_per_shard and busy.load_per_shard > 0
        assert after.complete, after.missing
        assert after.demand_by_tier["plus"] > 0 and after.rejections_by_tier.get("plus", 0.0) == 0.0
        assert after.error_rate == 0.0
        assert after.ttft_p95_s is not None and after.ttft_p95_s > 0
        assert after.tokens_per_s and after.tokens_per_s > 0
        assert after.capacity_per_shard == 16
        # the overload figures (what the ladder and the autoscaler read), all known after load
        for name in ("admission_wait_p95_s", "shard_queue_p95_s", "prefill_p95_s", "shard_ttft_p95_s",
                     "queue_time_p95_s", "ttft_excess_p95_s"):
            value = getattr(after, name)
            assert value is not None and value >= 0, name
        assert idle.batch_usage == 0.0 and busy.batch_usage is not None and busy.batch_usage > 0
        assert after.to_dict()["shards"][0]["member_id"] == "shard-0"  # JSON-ready for the admin API

        # freeze shard-1: it still counts as passing (30 s TTL) but its /metrics cannot be read
        frozen = cluster.shards[1].proc
        assert frozen is not None
        frozen.send_signal(signal.SIGSTOP)
        try:
            await members.refresh()
            stale = await source.read()
        finally:
            frozen.send_signal(signal.SIGCONT)
        assert not stale.complete
        assert stale.waiting_per_shard is None and stale.kv_usage is None  # unknown, never 0
        assert any(m.startswith("shard-1: scrape failed") for m in stale.missing), stale.missing
        s1 = next(s for s in stale.shards if s.member_id == "shard-1")
        assert s1.stale and s1.error and s1.running == 0.0  # last known values, flagged stale

        await members.refresh()
        assert (await source.read()).complete


# -- Prometheus -------------------------------------------------------------------------------------

@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")
async def test_prometheus_signals_match_the_scrape_ones(cluster: Cluster) -> None:
    shard_targets = [s.url.removeprefix("http://") for s in cluster.shards]
    with tempfile.TemporaryDirectory() as d:
        prometheus = Prometheus(Path(d), {"switchboard-shard": shard_targets,
                                          "switchboard-gateway": [cluster.gateway.url.removeprefix("http://")]},
                                scrape_timeout="800ms")
        prometheus.start()
        try:
            url = prometheus.url
            async with httpx.AsyncClient() as http:
                source = PrometheusSignals(url, http, window_s=10)
                await _until(lambda s: s.healthy_shards == 2 and s.complete, source, 20)
                # a counter series Prometheus first sees at N has no rate yet: let it see the tier first
                statuses = await _chat_load(cluster, http, 3, tier="enterprise")
                await asyncio.sleep(2.5)
                statuses += await _chat_load(cluster, http, 30, tier="enterprise")
                assert statuses == [200] * 33
                s = await _until(
                    lambda s: s.demand_by_tier.get("enterprise", 0) > 0 and s.ttft_p95_s is not None,
                    source,
                    15,
                )
                assert s.complete and s.source == "prometheus"
                assert s.waiting_per_shard == 0.0 and s.capacity_per_shard == 16 and s.error_rate == 0.0
                assert {sh.member_id for sh in s.shards} == set(shard_targets)
                assert s.batch_usage is not None
                # the Overview's TTFT p50 and TPOT tiles and the Cluster table's "KV kept": they said
                # "no data" under `up --prometheus` while the scrape reader filled them
                assert all(sh.prefix_cache_bytes is not None for sh in s.shards), s.shards
                for name in ("admission_wait_p95_s", "shard_queue_p95_s", "prefill_p95_s", "shard_ttft_p95_s",
                             "queue_time_p95_s", "ttft_excess_p95_s", "ttft_p50_s", "tpot_s"):
                    value = getattr(s, name)
                    assert value is not None and value >= 0, name

                frozen = cluster.shards[1].proc
                assert frozen is not None
                frozen.send_signal(signal.SIGSTOP)
                try:
                    s = await _until(lambda s: not s.complete, source, 10)
                finally:
                    frozen.send_signal(signal.SIGCONT)
                # a scrape that times out marks up == 0 and makes the shard's series stale at once:
                # whichever the reader meets first names the frozen shard
                assert any(("up == 0" in m or "no engine gauges" in m) and shard_targets[1] in m
                           for m in s.missing), s.missing
                assert s.waiting_per_shard is None

                gone = PrometheusSignals(f"http://127.0.0.1:{free_port()}", http)
                s = await gone.read()
                assert not s.complete and s.missing[0].startswith("prometheus: ")
        finally:
            prometheus.stop()


async def _until(cond, source: PrometheusSignals, timeout: float) -> Signals:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        s = await source.read()
        if cond(s) or time.monotonic() > deadline:
            assert cond(s), f"condition not met within {timeout}s: {s.summary()}"
            return s
        await asyncio.sleep(0.5)


async def test_a_shards_prefix_cache_hit_rate_and_bytes_over_the_window() -> None:
    clock, hits = FakeClock(0.0), [0.0]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=(
            'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0\nswitchboard_shard_max_num_seqs{model_name="m"} 4\n'
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {1000 + 400 * clock.now}\n'
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits[0]}\n'
            'switchboard_shard_prefix_cache_bytes{model_name="m"} 1048576\n'))

    members = [Member("shard-a", "shard", "http://127.0.0.1:9001")]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        source = ScrapeSignals(lambda s: [m for m in members if m.service == s], http, window_s=10,
                               min_interval_s=0, clock=clock)
        first = (await source.read()).shards[0]
        clock.now, hits[0] = 5.0, 1500.0
        second = (await source.read()).shards[0]
    assert first.prefix_hit_rate is None and first.prefix_cache_bytes == 1048576
    assert second.prefix_hit_rate == pytest.approx(1500 / 2000)


async def test_scrapes_present_the_token_members_guard_metrics_with() -> None:
    """Every /metrics answers 401 without the metrics (or cluster) token: the reader sends the headers it
    is built with (control_plane/signals/source.py: the cluster token, else the metrics token)."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer metrics-t":
            return httpx.Response(401, json={"error": {"code": "invalid_metrics_token"}})
        return httpx.Response(200, text='vllm:num_requests_running{model_name="m"} 1\n'
                                        'vllm:num_requests_waiting{model_name="m"} 0\n'
                                        'vllm:kv_cache_usage_perc{model_name="m"} 0\n'
                                        'switchboard_shard_max_num_seqs{model_name="m"} 4\n')

    members = [Member("shard-a", "shard", "http://127.0.0.1:9001")]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        def source(headers: dict[str, str] | None) -> ScrapeSignals:
            return ScrapeSignals(lambda s: members, http, min_interval_s=0, headers=headers)
        refused = (await source(None).read()).shards[0]
        read = (await source({"authorization": "Bearer metrics-t"}).read()).shards[0]
    assert refused.error and "401" in refused.error and refused.stale
    assert read.error is None and read.running == 1.0


async def test_a_session_store_outage_is_not_read_as_overload() -> None:
    """Every session turn a 503 `cache_unavailable` while a cache node (or Redis: `cache_backend_unavailable`)
    was down counted in the error rate the ladder reads: above 10 % under pressure it raised the level to 3
    and shed the whole free tier, sessionless requests included, though shedding cannot bring a store back.
    A shard failing requests (`upstream_error`) still counts."""
    clock = FakeClock(0.0)
    counts = {"ok": 100.0, "cache_unavailable": 0.0, "cache_backend_unavailable": 0.0, "upstream_error": 0.0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 9000:
            return httpx.Response(200, text="".join(
                f'switchboard_gateway_requests_total{{code="{code}",status="{200 if code == "ok" else 503 if "cache" in code else 502}",'
                f'tier="free"}} {n}\n' for code, n in counts.items()))
        return httpx.Response(200, text='vllm:num_requests_running{model_name="m"} 2\n'
                                        'vllm:num_requests_waiting{model_name="m"} 0\n')

    members = [Member("shard-a", "shard", "http://127.0.0.1:9001"), Member("gw", "gateway", "http://127.0.0.1:9000")]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        source = ScrapeSignals(lambda s: [m for m in members if m.service == s], http, window_s=10,
                               min_interval_s=0, clock=clock)
        await source.read()
        clock.now = 5.0
        counts.update(ok=150.0, cache_unavailable=30.0, cache_backend_unavailable=20.0)
        store_down = await source.read()
        clock.now = 10.0
        counts.update(ok=200.0, upstream_error=50.0)
        shard_failing = await source.read()
    assert store_down.error_rate == 0.0
    assert shard_failing.error_rate == pytest.approx(50 / 200)


def test_a_member_holding_only_the_cluster_token_is_read(tmp_path: Path) -> None:
    """A shard added by hand as the README says (SWITCHBOARD_CLUSTER_TOKEN only) joins a control plane that
    also holds the metrics token, as `switchboard up`'s does. The signal reader presented the metrics token,
    which that shard does not know: its /metrics answered 401, the shard was stale and the signals
    incomplete, so the autoscaler and the ladder were blind to it. The control plane holds the cluster
    token every member accepts: it reads with that one."""
    admin = {"Authorization": "Bearer signals-test-admin"}
    with Service(["control-plane", "--admin-token", "signals-test-admin", "--degradation-interval", "0.3"]) as cp, \
            Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", "by-hand"],
                    env={"SWITCHBOARD_METRICS_TOKEN": ""}) as shard:
        def read() -> dict | None:
            latest = httpx.get(cp.url + "/admin/v1/signals", headers=admin, timeout=5).json()["latest"]
            shards = {s["member_id"]: s for s in (latest or {}).get("shards", [])}
            return shards.get("by-hand")

        eventually(lambda: (read() or {}).get("running") is not None, 20, 0.2, what="the shard's gauges read",
                   detail=lambda: f"{read()}\n{shard.log_tail()}")
        seen = read() or {}
        assert seen["error"] is None and not seen["stale"] and seen["running"] == 0, seen
