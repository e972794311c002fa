"""Which of vLLM's Grafana dashboards' panels apply to Switchboard, and the series each needs.

    for panel in FILLS: panel.dashboard, panel.title, panel.series    # ("vLLM / Overview", "TTFT p95", (...))
    for panel in CANNOT_APPLY: panel.why                               # a bullet of docs/metrics.md

Our own list (no text of vLLM's dashboards): the dashboard and panel titles of vLLM's seven
dashboards (examples/observability/dashboards/grafana/*.json and
examples/online_serving/prometheus_grafana/grafana.json), with the metric names (an interface) their
queries select; the Service Status board's five untitled charts are named here by what they chart. A series is written ``name``, ``name{label}`` (the label present), ``name{label=value}``;
a trailing ``+`` means it must have increased in the window (a rate or a ratio of rates has data).
Every ``vllm:`` series but ``vllm:cache_config_info`` (as in vLLM) is also expected to carry
``model_name`` (the dashboards filter on it).
tests/observability/test_vllm_dashboards.py proves every FILLS panel's series against a live cluster;
each CANNOT_APPLY panel names (``why``) the bullet of docs/metrics.md that says why it stays empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OVERVIEW, KV, SPEC, CLASSIC = "vLLM / Overview", "vLLM / KV Cache", "vLLM / Speculative Decoding", "vLLM"
INSTANCES, STATUS = "vLLM / Instances", "vLLM / Service Status"
QUERIES, PERF = "Query Statistics_New4", "Performance Statistics"


@dataclass(frozen=True)
class Panel:
    dashboard: str
    title: str
    series: tuple[str, ...]


@dataclass(frozen=True)
class Skip:
    dashboard: str
    title: str
    why: str
    """The first `code` token of the docs/metrics.md bullet that says why the panel cannot fill."""


_SERIES = re.compile(r"^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})?(?P<moving>\+)?$")


def parse(series: str) -> tuple[str, dict[str, str | None], bool]:
    """``name{a,b=c}+`` -> ("name", {"a": None, "b": "c"}, True)."""
    m = _SERIES.match(series)
    assert m, series
    labels: dict[str, str | None] = {}
    for item in filter(None, (s.strip() for s in (m.group("labels") or "").split(","))):
        key, _, value = item.partition("=")
        labels[key] = value or None
    return m.group("name"), labels, bool(m.group("moving"))


NO_MODEL_NAME = {"vllm:cache_config_info"}


def _v(*names: str) -> tuple[str, ...]:
    return tuple("vllm:" + n if not n.startswith(("up", "process_", "http_")) else n for n in names)


TTFT, ITL, E2E = "time_to_first_token_seconds_count+", "inter_token_latency_seconds_count+", \
    "e2e_request_latency_seconds_count+"
TPOT = "request_time_per_output_token_seconds_count+"
HITS = ("prefix_cache_hits_total+", "prefix_cache_queries_total+")
DRAFTS = ("spec_decode_num_accepted_tokens_total+", "spec_decode_num_draft_tokens_total+",
          "spec_decode_num_drafts_total+")
SUCCESS = "request_success_total{finished_reason}+"
WAIT_CAP = "num_requests_waiting_by_reason{reason=capacity}"
SOURCES = ("prompt_tokens_by_source_total{source=local_compute}+", "prompt_tokens_by_source_total{source=local_cache_hit}+",
           "prompt_tokens_by_source_total{source=external_kv_transfer}")
PHASES = ("request_queue_time_seconds_count+", "request_prefill_time_seconds_count+",
          "request_decode_time_seconds_count+")

FILLS: tuple[Panel, ...] = tuple(Panel(d, t, _v(*s)) for d, t, s in [
    (CLASSIC, "E2E Request Latency", (E2E,)),
    (CLASSIC, "Token Throughput", ("prompt_tokens_total+", "generation_tokens_total+")),
    (CLASSIC, "Time Per Output Token Latency", ("time_per_output_token_seconds_count+",)),
    (CLASSIC, "Scheduler State", ("num_requests_running", "num_requests_waiting")),
    (CLASSIC, "Time To First Token Latency", (TTFT,)),
    (CLASSIC, "Request Prompt Length", ("request_prompt_tokens_count+",)),
    (CLASSIC, "Request Generation Length", ("request_generation_tokens_count+",)),
    (CLASSIC, "Finish Reason", (SUCCESS,)),
    (CLASSIC, "Queue Time", ("request_queue_time_seconds_count+",)),
    (CLASSIC, "Requests Prefill and Decode Time", PHASES[1:]),
    (CLASSIC, "Max Generation Token in Sequence Group", ("request_max_num_generation_tokens_count+",)),
    (OVERVIEW, "Requests / s", (SUCCESS,)),
    (OVERVIEW, "5xx ratio", ("http_requests_total{status=2xx}+",)),  # no 5xx wanted: the ratio is 0, not empty
    (OVERVIEW, "HTTP requests by status", ("http_requests_total{status}+",)),
    (OVERVIEW, "HTTP requests by endpoint", ("http_requests_total{handler=/v1/chat/completions}+",)),
    (OVERVIEW, "HTTP mean duration by endpoint", ("http_request_duration_seconds_count{handler}+",)),
    (OVERVIEW, "Input tok/s", ("prompt_tokens_total+",)),
    (OVERVIEW, "Output tok/s", ("generation_tokens_total+",)),
    (OVERVIEW, "TTFT p95", (TTFT,)),
    (OVERVIEW, "ITL p95", (ITL,)),
    (OVERVIEW, "E2E p95", (E2E,)),
    (OVERVIEW, "Unreachable", ("up",)),
    (OVERVIEW, "Engines", ("num_requests_running",)),
    (OVERVIEW, "Running", ("num_requests_running",)),
    (OVERVIEW, "Waiting", ("num_requests_waiting",)),
    (OVERVIEW, "KV cache", ("kv_cache_usage_perc",)),
    (OVERVIEW, "Preemptions", ("num_preemptions_total",)),
    (OVERVIEW, "Prefix hits", HITS),
    (OVERVIEW, "TTFT SLO", ("time_to_first_token_seconds_bucket{le=1.0}", TTFT)),  # a bucket boundary
    (OVERVIEW, "TPOT SLO", ("request_time_per_output_token_seconds_bucket{le=0.1}", TPOT)),
    (OVERVIEW, "Per-model summary (selected time range)", ("num_requests_running", SUCCESS, "generation_tokens_total+",
                                                          TTFT, ITL, E2E, "kv_cache_usage_perc", "num_preemptions_total")),
    (OVERVIEW, "Time to first token (TTFT)", (TTFT,)),
    (OVERVIEW, "Inter-token latency (ITL)", (ITL,)),
    (OVERVIEW, "Time per output token (TPOT)", (TPOT,)),
    (OVERVIEW, "End-to-end latency", (E2E,)),
    (OVERVIEW, "Queue time", PHASES[:1]),
    (OVERVIEW, "Mean time per request phase", PHASES),
    (OVERVIEW, "TTFT distribution", (TTFT,)),
    (OVERVIEW, "Inter-token latency distribution", (ITL,)),
    (OVERVIEW, "End-to-end latency distribution", (E2E,)),
    (OVERVIEW, "Token throughput", ("prompt_tokens_total+", "generation_tokens_total+")),
    (OVERVIEW, "Finished requests by reason", (SUCCESS,)),
    (OVERVIEW, "Scheduler queue", ("num_requests_running", WAIT_CAP)),
    (OVERVIEW, "KV cache usage", ("kv_cache_usage_perc",)),
    (OVERVIEW, "Preemptions / s", ("num_preemptions_total",)),
    (OVERVIEW, "Tokens per engine step", ("iteration_tokens_total_count+",)),
    (OVERVIEW, "Cache hit rates", HITS),
    (OVERVIEW, "Prompt tokens by source", SOURCES),
    (OVERVIEW, "Prompt length", ("request_prompt_tokens_count+",)),
    (OVERVIEW, "Output length", ("request_generation_tokens_count+",)),
    (OVERVIEW, "Finish reason share", (SUCCESS,)),
    (OVERVIEW, "Prompt length distribution", ("request_prompt_tokens_count+",)),
    (OVERVIEW, "Output length distribution", ("request_generation_tokens_count+",)),
    (KV, "Max KV cache usage", ("kv_cache_usage_perc",)),
    (KV, "Mean KV cache usage", ("kv_cache_usage_perc",)),
    (KV, "Prefix cache hit rate", HITS),
    (KV, "Cached prompt tokens", ("prompt_tokens_cached_total+", "prompt_tokens_total+")),
    (KV, "Preemptions / s", ("num_preemptions_total",)),
    (KV, "Waiting for capacity", (WAIT_CAP,)),
    (KV, "KV cache usage by engine", ("kv_cache_usage_perc",)),
    (KV, "Scheduler queue", ("num_requests_running", WAIT_CAP)),
    (KV, "Preemptions / s by engine", ("num_preemptions_total",)),
    (KV, "Prompt tokens by source", SOURCES),
    (KV, "Prefix cache hit rate by engine", HITS),
    (KV, "Cached prompt tokens by tier", ("prompt_tokens_cached_by_source_total{source=device}+",)),
    (KV, "Prompt and computed tokens per request", ("request_prompt_tokens_count+",
                                                     "request_prefill_kv_computed_tokens_count+")),
    (KV, "Cache hit rates", HITS),
    (KV, "Block lifetime", ("kv_block_lifetime_seconds_count+",)),
    (KV, "Idle time before eviction", ("kv_block_idle_before_evict_seconds_count+",)),
    (KV, "Block reuse gap", ("kv_block_reuse_gap_seconds_count+",)),
    (KV, "External prefix cache hit rate", ("external_prefix_cache_queries_total+", "external_prefix_cache_hits_total")),
    (KV, "Prompt tokens loaded via KV transfer", SOURCES[2:]),
    (KV, "Offload throughput", ("kv_offload_store_bytes_total+", "kv_offload_load_bytes_total")),
    (KV, "Offload transfer bandwidth", ("kv_offload_store_bytes_total+", "kv_offload_store_time_total+",
                                        "kv_offload_load_bytes_total", "kv_offload_load_time_total")),
    (KV, "Mean offload transfer size", ("kv_offload_store_size_count+", "kv_offload_load_size_count")),
    (SPEC, "Draft acceptance rate", DRAFTS[:2]),
    (SPEC, "Acceptance length", DRAFTS[::2]),
    (SPEC, "Accepted tokens / s", DRAFTS[:1]),
    (SPEC, "Draft tokens / s", DRAFTS[1:2]),
    (SPEC, "Drafts / s", DRAFTS[2:]),
    (SPEC, "Output from drafts", (DRAFTS[0], "generation_tokens_total+")),
    (SPEC, "Mean acceptance length", DRAFTS[::2]),
    (SPEC, "Acceptance rate by draft position", ("spec_decode_num_accepted_tokens_per_pos_total{position}",
                                                 DRAFTS[2])),
    (SPEC, "Draft acceptance rate by engine", DRAFTS[:2]),
    (SPEC, "Inter-token latency", (ITL,)),
    (INSTANCES, "Instances (last 5 minutes)", ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                               SUCCESS, "generation_tokens_total+", TTFT, ITL, "num_preemptions_total",
                                               "process_start_time_seconds")),
    (INSTANCES, "Running requests", ("num_requests_running",)),
    (INSTANCES, "Waiting requests", ("num_requests_waiting",)),
    (INSTANCES, "KV cache usage", ("kv_cache_usage_perc",)),
    (INSTANCES, "Requests / s", (SUCCESS,)),
    (INSTANCES, "Input tokens / s", ("prompt_tokens_total+",)),
    (INSTANCES, "Output tokens / s", ("generation_tokens_total+",)),
    (INSTANCES, "TTFT p95", (TTFT,)),
    (INSTANCES, "Inter-token latency p95", (ITL,)),
    (INSTANCES, "E2E latency p95", (E2E,)),
    (INSTANCES, "Mean queue time", PHASES[:1]),
    (INSTANCES, "Engine steps / s", ("iteration_tokens_total_count+",)),
    (INSTANCES, "Mean tokens per engine step", ("iteration_tokens_total_count+",)),
    (INSTANCES, "Preemptions / s", ("num_preemptions_total",)),
    (INSTANCES, "Waiting requests by reason", ("num_requests_waiting_by_reason{reason}",)),
    (INSTANCES, "Prefix cache hit rate", HITS),
    (INSTANCES, "CPU usage", ("process_cpu_seconds_total+",)),
    (INSTANCES, "Resident memory", ("process_resident_memory_bytes",)),
    (INSTANCES, "Open file descriptors", ("process_open_fds", "process_max_fds")),
    (INSTANCES, "Cache configuration", ("cache_config_info{block_size,cache_dtype,enable_prefix_caching,num_gpu_blocks}",)),
    (INSTANCES, "Engine sleep state", ("engine_sleep_state{sleep_state=awake}", "engine_sleep_state{sleep_state=discard_all}")),
    *((STATUS, title, ("engine_sleep_state{sleep_state=awake}",)) for title in ("Status", "Status over time")),
    *((STATUS, title, (TTFT, "num_requests_running")) for title in ("Response time", "Response time over time")),
    *((STATUS, title, ("generation_tokens_total+", "num_requests_running")) for title in ("Output speed",
                                                                                          "Output speed over time")),
    *((STATUS, title, (SUCCESS, "num_requests_running")) for title in ("Success rate", "Success rate over time",
                                                                       "Requests / min", "Requests / min over time")),
    *((QUERIES, title, (SUCCESS,)) for title in ("Successful Requests Over Time", "Requests Avg Rate")),
    *((QUERIES, f"{p} Latency", (E2E,)) for p in ("p50", "p90", "p99")),
    *((QUERIES, title, ("request_prompt_tokens_count+",)) for title in (
        "Input Token Size Distribution", "Input Token Size p90", "Input Token Size p50", "Input Token Size p99")),
    (QUERIES, "Input Token Size Avg", ("prompt_tokens_total+", SUCCESS)),
    *((QUERIES, title, ("prompt_tokens_total+",)) for title in ("Input Tokens Over Time", "Input Tokens/Sec Avg")),
    *((QUERIES, title, ("generation_tokens_total+",)) for title in ("Output Tokens Over Time", "Output Tokens/Sec Avg")),
    *((PERF, f"E2E Latency {s}", (E2E,)) for s in ("over Time", "(P99)", "(P90)", "(Avg)", "(P50)")),
    *((PERF, f"TTFT {s}", (TTFT,)) for s in ("Over Time", "(P99)", "(P90)", "(Avg)", "(P50)")),
    *((PERF, f"ITL {s}", (ITL,)) for s in ("(Time Per Output Token) Over Time", "(P90)", "(P99)", "(Avg)", "(P50)")),
    (PERF, "TPS (Tokens Per Second) Over Time", ("generation_tokens_total+", "prompt_tokens_total+",
                                                 "iteration_tokens_total_count+")),
])

NIXL = "`vllm:nixl_*`"
SIMPLE = "`vllm:simple_kv_offload_*`"
CANNOT_APPLY: tuple[Skip, ...] = tuple(Skip(d, t, w) for d, t, w in [
    (CLASSIC, "Cache Utilization", "`vllm:gpu_cache_usage_perc`"),
    (KV, "Requests waiting on KV loads", "`vllm:num_requests_kv_fetch_by_stage`"),
    *((KV, t, NIXL) for t in ("Transfer duration", "Transfer throughput", "Transfers / s", "Bytes per transfer",
                              "Transfer post time", "Descriptors per transfer", "Transfer failures / s")),
    (KV, "Offload lookup latency p99", "`vllm:kv_offload_lookup_sync_delay_seconds`"),
    (KV, "CPU offload buffer usage", "`vllm:kv_offload_cpu_cache_usage_perc`"),
    (KV, "Failed and skipped stores / s", "`vllm:kv_offload_allocation_failure_total`"),
    *((KV, t, SIMPLE) for t in ("Store admission outcomes", "Blocks restored from offload / s", "Offload pool blocks")),
    (INSTANCES, "LoRA adapters", "`vllm:lora_requests_info`"),
    (INSTANCES, "Sleep mode and weight update operations (since process start)",
     "`vllm:sleep_mode_operation_duration_seconds`"),
    (INSTANCES, "Estimated compute per GPU", "`vllm:estimated_flops_per_gpu_total`"),
    (INSTANCES, "Estimated memory traffic per GPU", "`vllm:estimated_flops_per_gpu_total`"),
])
