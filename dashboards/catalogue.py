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
    from data_plane.shard.metrics import ShardMetrics

    metrics = ShardMetrics(registry, model_name="catalogue")
    return [metrics, metrics.spec, metrics.kv_tier, metrics.grammar, KVReportMetrics(registry, "catalogue"),
            SlowClientMetrics(registry, "shard")]


def _gateway(registry: CollectorRegistry) -> list[object]:
    # What data_plane.gateway.app.Gateway and its SessionStore register on the gateway's registry.
    from data_plane.gateway.admission import AdmissionMetrics
    from data_plane.cache.client import SessionStoreMetrics
    from data_plane.gateway.abuse import AbuseGuardMetrics
    from data_plane.gateway.metrics import GatewayMetrics
    from data_plane.ledger.writer import LedgerMetrics
    from data_plane.gateway.ratelimit.limiter import RateLimitMetrics
    from data_plane.routing.router import RouterMetrics
    from data_plane.gateway.safety.pipeline import SafetyMetrics
    from data_plane.common.crypto import SealMetrics

    return [GatewayMetrics(registry), SafetyMetrics(registry), RouterMetrics(registry),
            SessionStoreMetrics(registry), RateLimitMetrics(registry), AdmissionMetrics(registry),
            LedgerMetrics(registry), SealMetrics(registry), AbuseGuardMetrics(registry), SlowClientMetrics(registry, "gateway")]


def _cache_node(registry: CollectorRegistry) -> list[object]:
    from data_plane.cache.kv_routes import KVNodeMetrics
    from data_plane.cache.node import CacheNodeMetrics

    return [CacheNodeMetrics(registry), KVNodeMetrics(registry), SlowClientMetrics(registry, "cache")]


def _control_plane(registry: CollectorRegistry) -> list[object]:
    from control_plane.scaling.loop import AutoscalerMetrics
    from control_plane.degradation import DegradationMetrics
    from control_plane.registry.embedded import RegistryMetrics
    from control_plane.settings import DEFAULT_SERVICES
    from control_plane.abuse.monitor import AbuseMetrics
    from control_plane.zones import ZoneMetrics

    return [RegistryMetrics(registry, DEFAULT_SERVICES), DegradationMetrics(registry), AutoscalerMetrics(registry),
            ZoneMetrics(registry), AbuseMetrics(registry), SlowClientMetrics(registry, "control_plane")]


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
    names: dict[str, Metric | None] = {name: None for name in SCRAPE_SERIES}
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
        "the job names below are the ones `alerts/` and `dashboards/` assume.",
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
    lines += ["## Prometheus (every target)", "", "| metric | type | labels | help |", "|---|---|---|---|"]
    for name, (kind, help_text) in SCRAPE_SERIES.items():
        lines.append(f"| `{name}` | {kind} | — | {help_text} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    sys.stdout.write(render_markdown())


if __name__ == "__main__":
    main()
