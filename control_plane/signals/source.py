"""Which signal source a control plane reads: Prometheus with ``--prometheus URL``, else its own scrapes.

    source = build_signal_source(settings, registry, http)    # control_plane/app.py, once at start-up
    signals = await source.read()

Both sources live beside it: control_plane/signals/scrape.py (scraping every member's /metrics) and
control_plane/signals/prometheus.py (PromQL over a Prometheus that scrapes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from control_plane.signals.model import SignalSource
from control_plane.signals.prometheus import PrometheusSignals
from control_plane.signals.scrape import ScrapeSignals
from data_plane.common.hop_auth import cluster_headers

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings


def build_signal_source(settings: ControlPlaneSettings, registry: Any, http: httpx.AsyncClient) -> SignalSource:
    """The source the settings ask for: Prometheus with ``--prometheus URL``, else scraping."""
    window_s = getattr(settings, "signals_window_s", 30.0)
    prometheus = getattr(settings, "prometheus", None)
    if prometheus:
        return PrometheusSignals(prometheus, http, window_s=window_s)

    def secret(name: str) -> str | None:
        value = getattr(settings, name, None)
        return value.get_secret_value() if value else None

    # The cluster token first: every member accepts it, while the metrics token opens only the /metrics of
    # members started with the same one (a shard added by hand with SWITCHBOARD_CLUSTER_TOKEN alone, a pod
    # started before the Secret had metrics-token answered 401: the shard stale, the signals incomplete).
    token = secret("cluster_token") or secret("metrics_token")
    return ScrapeSignals.from_registry(registry, http, window_s=window_s, headers=cluster_headers(token))
