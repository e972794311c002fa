"""The names vLLM's dashboards look for, on a live cluster: the process collector on every process,
and the shard's vLLM series (success by finish reason, waiting by reason, cache config, TPOT, prompt
tokens by source, KV block residency, offload sizes, sleep state, the API server's HTTP series)
exported under vLLM's names and labels.

    .venv/bin/python -m pytest tests/observability/test_vllm_names.py -q      # ~15 s, synthetic engine

The synthetic engine keeps no KV, so the residency histograms and offload sizes exist at zero here;
their feeds are tested in tests/data_plane/test_kv_cache.py and the KV-tier tests.
"""

from __future__ import annotations

import httpx

from tests.support.cluster import Cluster
from tests.support.metrics import metric, scrape

PROCESS = ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
           "process_start_time_seconds")
SHARD_SERIES = (
    "vllm:num_requests_waiting_by_reason", "vllm:cache_config_info",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:prompt_tokens_by_source_total",
    "vllm:prompt_tokens_cached_by_source_total", "vllm:kv_block_lifetime_seconds_bucket",
    "vllm:kv_block_idle_before_evict_seconds_bucket", "vllm:kv_block_reuse_gap_seconds_bucket",
    "vllm:kv_offload_store_size_bucket", "vllm:kv_offload_load_size_bucket",
)


def test_vllm_dashboard_names_are_exported() -> None:
    with Cluster(shards=1, caches=1, engine="synthetic") as cluster:
        chat = {"messages": [{"role": "user", "content": "name the metrics"}]}
        auth = {"Authorization": f"Bearer {cluster.keys['plus']}"}
        with httpx.Client(base_url=cluster.gateway.url, timeout=30.0) as http:
            for max_tokens in (1, 4, 6):
                r = http.post("/v1/chat/completions", json={**chat, "max_tokens": max_tokens}, headers=auth)
                assert r.status_code == 200, r.text
        for service in (cluster.control_plane, cluster.gateway, cluster.shards[0], cluster.caches[0]):
            text = scrape(service.url)
            for name in PROCESS:
                assert f"\n{name} " in text, (service.url, name)
        shard = cluster.shards[0].url
        text = scrape(shard)
        for name in SHARD_SERIES:
            assert f"\n{name}{{" in text, name
        assert metric(shard, "vllm:request_success_total", finished_reason="length") == 3
        for reason in ("stop", "abort", "error"):  # every finished_reason series exists, at 0
            assert f'finished_reason="{reason}"' in text
        assert metric(shard, "vllm:request_time_per_output_token_seconds_count") == 2  # 1 token: no TPOT
        prompt = metric(shard, "vllm:prompt_tokens_total")
        assert prompt > 0
        assert metric(shard, "vllm:prompt_tokens_by_source_total", source="local_compute") == prompt
        assert metric(shard, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert metric(shard, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
        assert metric(shard, "vllm:cache_config_info", enable_prefix_caching="False") == 1
        assert metric(shard, "vllm:engine_sleep_state", sleep_state="awake") == 1
        assert metric(shard, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
        # vLLM's API server HTTP series on the shard: routes as templates, status classes, no probes
        assert metric(shard, "http_requests_total", handler="/v1/chat/completions", method="POST", status="2xx") == 3
        assert metric(shard, "http_request_duration_seconds_count", handler="/v1/chat/completions") == 3
        assert 'handler="/metrics"' not in text and 'handler="/health"' not in text and 'handler="none"' not in text
        assert httpx.get(shard + "/no-such-route", timeout=5.0).status_code == 404
        assert metric(shard, "http_requests_total", handler="none", method="other", status="4xx") == 1
