"""The metrics catalogue, read from the code so it cannot drift from what the processes export.

    python -m dashboards.catalogue > docs/metrics.md      # regenerate the reference page

    from dashboards.catalogue import catalogue, series_names
    {m.name for m in catalogue()}          # metric families, e.g. "vllm:prompt_tokens"
    "vllm:prompt_tokens_total" in series_names()   # what PromQL sees in the exposition

Each process's metrics classes are instantiated against a fresh
:class:`prometheus_client.CollectorRegistry`, and the registry is walked through its public
``collect()``; label names come from each metric object's ``_labelnames``. Dashboards, alert
rules and their tests only use names this module returns (``tests/observability`` checks it).

The scrape job names in :data:`JOBS` are the ones the alert rules and dashboards assume.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from data_plane.common.hop_auth import RefusalMetrics
from data_plane.common.http_metrics import HttpMetrics
from data_plane.common.slow_clients import SlowClientMetrics

JOBS: dict[str, str] = {
    "control-plane": "switchboard-control-plane",
    "gateway": "switchboard-gateway",
    "shard": "switchboard-shard",
    "cache-node": "switchboard-cache",
}
"""Process (the `switchboard` subcommand) -> the Prometheus scrape job that scrapes its /metrics."""

TARGET_LABELS = ("job", "instance")
"""Labels Prometheus attaches to every scraped series."""

SCRAPE_SERIES: dict[str, tuple[str, str]] = {
    "up": ("gauge", "1 if Prometheus' last scrape of the target succeeded, else 0."),
    "scrape_duration_seconds": ("gauge", "How long the last scrape of the target took."),
}
"""Series Prometheus itself writes for every target (not exported by the code)."""

PROCESS_SERIES: dict[str, tuple[str, str]] = {
    "process_cpu_seconds_total": ("counter", "CPU time (user + system) the process used, seconds."),
    "process_resident_memory_bytes": ("gauge", "Resident memory, bytes."),
    "process_virtual_memory_bytes": ("gauge", "Virtual memory, bytes."),
    "process_start_time_seconds": ("gauge", "Start time of the process, Unix seconds."),
    "process_open_fds": ("gauge", "Open file descriptors."),
    "process_max_fds": ("gauge", "The open file descriptor limit."),
}
"""prometheus_client's process collector, on every process's registry (data_plane/common/telemetry.py
``add_process_collector``); Linux only."""

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("", "_sum", "_count"), "info": ("_info",)}
"""What prometheus_client appends to a family's name in the exposition (``_created`` left out:
it can be switched off with PROMETHEUS_DISABLE_CREATED_SERIES, so nothing should rely on it)."""


@dataclass(frozen=True)
class Metric:
    name: str
    """The family name, as declared in the code (prometheus_client strips a trailing ``_total``)."""
    type: str
    """counter | gauge | histogram | summary | info."""
    labels: tuple[str, ...]
    """Label names the code sets (Prometheus adds ``job`` and ``instance``; histograms add ``le``)."""
    help: str
    process: str
    """The `switchboard` subcommand whose /metrics exports it."""

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names in the exposition, i.e. what PromQL selects."""
        return tuple(self.name + s for s in SUFFIXES[self.type])


def _shard(registry: CollectorRegistry) -> list[object]:
    from data_plane.shard.kv_reports import KVReportMetrics
    from data_plane.shard.metrics import REFUSED_ROUTES, ShardMetrics

    metrics = ShardMetrics(registry, model_name="catalogue")
    return [metrics, metrics.spec, metrics.kv_tier, metrics.grammar, KVReportMetrics(registry, "catalogue"),
            SlowClientMetrics(registry, "shard"), HttpMetrics(registry), RefusalMetrics(registry, "shard", REFUSED_ROUTES)]


def _gateway(registry: CollectorRegistry) -> list[object]:
    # What data_plane.gateway.app.Gateway and its SessionStore register on the gateway's registry.
    from data_plane.cache.client_metrics import SessionStoreMetrics
    from data_plane.common.crypto import SealMetrics
    from data_plane.gateway.abuse import AbuseGuardMetrics
    from data_plane.gateway.admission import AdmissionMetrics
    from data_plane.gateway.memory import MemoryMetrics
    from data_plane.gateway.metrics import REFUSED_ROUTES, GatewayMetrics
    from data_plane.gateway.ratelimit.limiter import RateLimitMetrics
    from data_plane.gateway.response_cache import ResponseCacheMetrics
    from data_plane.gateway.responses_background import BackgroundMetrics
    from data_plane.gateway.responses_metrics import ResponsesMetrics
    from data_plane.gateway.safety.pipeline import SafetyMetrics
    from data_plane.gateway.tier_gate import TierGate
    from data_plane.ledger.writer import LedgerMetrics
    from data_plane.routing.router import RouterMetrics

    return [GatewayMetrics(registry), SafetyMetrics(registry), RouterMetrics(registry),
            SessionStoreMetrics(registry), RateLimitMetrics(registry), AdmissionMetrics(registry),
            LedgerMetrics(registry), SealMetrics(registry), AbuseGuardMetrics(registry), SlowClientMetrics(registry, "gateway"),
            ResponseCacheMetrics(registry), MemoryMetrics(registry), ResponsesMetrics(registry), TierGate(registry),
            BackgroundMetrics(registry), RefusalMetrics(registry, "gateway", REFUSED_ROUTES)]


def _cache_node(registry: CollectorRegistry) -> list[object]:
    from data_plane.cache.kv_routes import KVNodeMetrics
    from data_plane.cache.node import CacheNodeMetrics

    metrics = CacheNodeMetrics(registry)
    return [metrics, metrics.refusals, KVNodeMetrics(registry), SlowClientMetrics(registry, "cache")]


def _control_plane(registry: CollectorRegistry) -> list[object]:
    from control_plane.abuse.monitor import AbuseMetrics
    from control_plane.abuse.persist import AbuseStateMetrics
    from control_plane.admin.processes import ProcessMetrics
    from control_plane.app import REFUSED_ROUTES
    from control_plane.degradation import DegradationMetrics
    from control_plane.policy_store import StateWriteMetrics
    from control_plane.registry.embedded import RegistryMetrics
    from control_plane.scaling.loop import AutoscalerMetrics
    from control_plane.settings import DEFAULT_SERVICES
    from control_plane.zones import ZoneMetrics

    return [RegistryMetrics(registry, DEFAULT_SERVICES), DegradationMetrics(registry), AutoscalerMetrics(registry),
            ZoneMetrics(registry), AbuseMetrics(registry), AbuseStateMetrics(registry),
            SlowClientMetrics(registry, "control_plane"), ProcessMetrics(registry), StateWriteMetrics(registry),
            RefusalMetrics(registry, "control_plane", REFUSED_ROUTES)]


PROCESSES: dict[str, Callable[[CollectorRegistry], list[object]]] = {
    "control-plane": _control_plane,
    "gateway": _gateway,
    "shard": _shard,
    "cache-node": _cache_node,
}
"""Process -> builds that process's metrics objects on a registry (as its entry point does)."""


def _labelnames(holders: Iterable[object]) -> dict[str, tuple[str, ...]]:
    """Family name -> label names, from the metric objects the metrics classes hold."""
    found: dict[str, tuple[str, ...]] = {}
    for holder in holders:
        for value in vars(holder).values():
            if isinstance(value, MetricWrapperBase):
                found[value._name] = tuple(value._labelnames)
    return found


def process_metrics(process: str) -> list[Metric]:
    """The metrics one process exports, sorted by name."""
    registry = CollectorRegistry()
    labels = _labelnames(PROCESSES[process](registry))
    out = []
    for family in registry.collect():
        if family.name not in labels:
            raise RuntimeError(f"{process}: metric {family.name!r} is registered but not held by a "
                               "metrics class attribute; the catalogue cannot read its labels")
        out.append(Metric(family.name, family.type, labels[family.name], family.documentation, process))
    return sorted(out, key=lambda m: m.name)


def catalogue() -> list[Metric]:
    """Every metric every Switchboard process exports, by process then name."""
    return [m for process in PROCESSES for m in process_metrics(process)]


def series_names() -> dict[str, Metric | None]:
    """Every series name PromQL may select -> its metric (None for Prometheus' own ``up`` & co)."""
    names: dict[str, Metric | None] = {name: None for name in (*SCRAPE_SERIES, *PROCESS_SERIES)}
    for metric in catalogue():
        for series in metric.series:
            names[series] = metric
    return names


def render_markdown() -> str:
    """docs/metrics.md."""
    lines = [
        "# Metrics reference",
        "",
        "<!-- Generated from the code by `python -m dashboards.catalogue > docs/metrics.md`; do not edit.",
        "     tests/observability/test_catalogue.py fails when this file and the code disagree. -->",
        "",
        "Every metric the Switchboard processes export on `/metrics`, read from the metrics classes",
        "themselves. Names are as PromQL sees them: counters end in `_total`; a histogram `h` is",
        "`h_bucket{le}`, `h_sum` and `h_count`. Prometheus adds `job` and `instance` to every series;",
        "the job names below are the ones `alerts/` and `dashboards/` assume. Every `/metrics` answers only",
        "`Authorization: Bearer <SWITCHBOARD_METRICS_TOKEN or SWITCHBOARD_CLUSTER_TOKEN>` (401 otherwise;",
        "`switchboard up` writes `.switchboard/metrics_token`): `curl -H \"Authorization: Bearer $(cat",
        ".switchboard/metrics_token)\" localhost:8000/metrics`.",
        "",
        "To regenerate after changing a metric: `.venv/bin/python -m dashboards.catalogue > docs/metrics.md`.",
        "",
    ]
    for process, job in JOBS.items():
        lines += [f"## {process} (`job=\"{job}\"`)", "",
                  "| metric | type | labels | help |", "|---|---|---|---|"]
        for m in process_metrics(process):
            series = ", ".join(f"`{s}`" for s in m.series)
            labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
            lines.append(f"| {series} | {m.type} | {labels} | {m.help.replace('|', chr(92) + '|')} |")
        lines.append("")
    lines += ["## Every process (the process collector)", "", "| metric | type | labels | help |", "|---|---|---|---|"]
    for name, (kind, help_text) in PROCESS_SERIES.items():
        lines.append(f"| `{name}` | {kind} | — | {help_text} |")
    lines += ["", "## Prometheus (every target)", "", "| metric | type | labels | help |", "|---|---|---|---|"]
    for name, (kind, help_text) in SCRAPE_SERIES.items():
        lines.append(f"| `{name}` | {kind} | — | {help_text} |")
    lines.append("")
    lines += [*_label_values(), NOTES]
    return "\n".join(lines)


def _label_values() -> list[str]:
    """The bounded label values the code defines as enums or constants, read from them."""
    from control_plane.ladder import Actor, Direction, Outcome
    from data_plane.gateway.metrics import RequestCode
    from data_plane.routing.failures import FailureReason
    from data_plane.shard.metrics import (
        CACHED_SOURCES,
        FINISHED_REASONS,
        PROMPT_SOURCES,
        SLEEP_STATES,
        WAITING_REASONS,
    )

    values = [
        ("`switchboard_gateway_requests_total`", "code", [c.value for c in RequestCode]),
        (("`switchboard_router_upstream_failures_total`, `switchboard_router_retries_total`, "
         "`switchboard_router_resumes_total`"), "reason", [r.value for r in FailureReason]),
        ("`switchboard_degradation_evaluations_total`", "outcome", [o.value for o in Outcome]),
        ("`switchboard_degradation_changes_total`", "direction", [d.value for d in Direction]),
        ("`switchboard_degradation_changes_total`", "actor", [a.value for a in Actor]),
        ("`vllm:request_success_total`", "finished_reason", list(FINISHED_REASONS)),
        ("`vllm:prompt_tokens_by_source_total`", "source", list(PROMPT_SOURCES)),
        ("`vllm:prompt_tokens_cached_by_source_total`", "source", list(CACHED_SOURCES)),
        ("`vllm:num_requests_waiting_by_reason`", "reason", list(WAITING_REASONS)),
        ("`vllm:engine_sleep_state`", "sleep_state", list(SLEEP_STATES)),
    ]
    lines = ["## Label values", "", "Labels whose values come from an enum in the code (bounded by construction).",
             "", "| metric | label | values |", "|---|---|---|"]
    lines += [f"| {metric} | `{label}` | {', '.join(f'`{v}`' for v in vals)} |" for metric, label, vals in values]
    return [*lines, ""]


NOTES = """## Changes to label values

- `switchboard_gateway_requests_total{code}`: bounded to the codes above; any other code (one a remote
  server put in its error, which the gateway passes on to the client and into the usage ledger's
  `error_code`) is `other`. It was the code as given: unbounded. The dashboards sum by `code` and the
  error-ratio rules select `code!~"ok|client_disconnected"`, both values unchanged, so both keep working.
- `switchboard_router_upstream_failures_total{reason}` and `switchboard_router_retries_total{reason}`: a
  shard's HTTP status other than 429, 500, 502, 503 and 504 is `status_5xx` (it was `status_<code>`, one
  value per status a shard could send).
- `switchboard_router_resumes_total{reason}`: what broke the stream (`stream_broken`, `stream_idle`,
  `membership_lost`, `stream_error`), where it was the error code of the failure (`upstream_error`,
  `upstream_timeout`, or whatever code a shard's error event carried: unbounded). The dashboards sum by
  `reason` and the alerts do not select values, so both keep working.

## vLLM dashboard panels that cannot apply here

vLLM's own Grafana dashboards run against `switchboard up` unchanged (`switchboard dashboards check --dir
DIR --prometheus URL` lists which panels fill); these panels stay empty. Each bullet opens with the series
it is about; tests/observability/vllm_panels.py names, for every such panel, its bullet (a test keeps the
two in step):

- `vllm:gpu_cache_usage_perc`: GPU cache usage, vLLM's earlier name of `vllm:kv_cache_usage_perc` (which
  is exported); shards run on CPU.
- `vllm:num_requests_kv_fetch_by_stage`: nothing waits on a KV transfer here (a shard fetches from the
  cache nodes before it queues the request), so `vllm:num_requests_waiting_by_reason{reason="deferred"}`
  is not exported either; only `capacity` is.
- `vllm:nixl_*`: NIXL transfers between GPU instances (vLLM's NixlConnector); no such connector here.
- `vllm:kv_offload_lookup_sync_delay_seconds`: and `..._async_delay_seconds`: a shard decides
  fetch-or-recompute from its own index without a lookup call; the fetch itself is `..._load_time`.
- `vllm:kv_offload_cpu_cache_usage_perc`: and the write / read shares: the OffloadingConnector's pinned
  CPU buffer; the cache-node tier has none (it is reported under the flat names `vllm:kv_offload_store_bytes`,
  `..._load_bytes`, `..._store_time`, `..._load_time`, `..._store_size`, `..._load_size`, without vLLM's
  `transfer_type` label: there is no GPU to transfer to or from).
- `vllm:kv_offload_allocation_failure_total`: and `vllm:kv_offload_stores_skipped_total`: a cache node
  evicts its least recently used blocks to make room (never refuses a store for space), and every
  sealed block is stored (no reuse threshold).
- `vllm:simple_kv_offload_*`: vLLM's SimpleCPUOffloadConnector pool; no such connector here.
- `vllm:lora_requests_info`: LoRA adapters; none are served.
- `vllm:sleep_mode_operation_duration_seconds`: and `vllm:rl_weight_update_operation_duration_seconds`:
  no sleep mode API and no RL weight updates (`vllm:engine_sleep_state` is exported: always `awake`).
- `vllm:estimated_flops_per_gpu_total`: and the read / write bytes estimates (MFU): no GPU.
- `vllm:mm_cache_*`: multimodal cache: text only (the "Cache hit rates" panels still fill from their
  prefix-cache query). Nor corrupted requests (NaN logits), the `vllm:prompt_tokens_cached_by_source`
  tiers `host`, `p2p` and `disk`, or the `engine` label (one engine per shard process: `instance`
  tells them apart).

`vllm:kv_block_*_seconds` come from the torch engine's prefix cache (every block, not sampled); the
synthetic and vLLM engines report none. `vllm:spec_decode_*` and `vllm:prefix_cache_*` move only on the
torch engine (speculation and a prefix cache on).
"""


def main(argv: list[str] | None = None) -> None:
    sys.stdout.write(render_markdown())


if __name__ == "__main__":
    main()
