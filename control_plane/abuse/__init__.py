"""Usage monitoring: suspicious patterns met with graduated, expiring responses (issue 28).

    monitor, router = build_abuse(settings, usage_store, metrics_registry, cluster_token)
    app.include_router(router); await monitor.start() ... await monitor.aclose()

model.py (rules, responses, thresholds), rules.py (detection), monitor.py (the ladder, expiry,
review), api.py (gateways' watch and reports, operators' list/lift/confirm). The gateways apply the
actions in data_plane/gateway/abuse.py; the console's Abuse page shows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CollectorRegistry

from control_plane.abuse.api import build_abuse_router
from control_plane.abuse.model import AbuseConfig
from control_plane.abuse.monitor import AbuseMetrics, AbuseMonitor, ActivitySource
from control_plane.abuse.persist import open_state_file


def build_abuse(settings: Any, usage_store: ActivitySource | None, registry: CollectorRegistry,
                cluster_token: str | None, on_refused: Callable[[Request], None] | None = None,
                ) -> tuple[AbuseMonitor, APIRouter]:
    """The monitor (over the usage ledger, thresholds from ``--abuse-rules``, its state sealed in
    ``--state-dir``) and its routes; `on_refused` counts the members' calls refused for the cluster token."""
    rules = getattr(settings, "abuse_rules", None)
    config = AbuseConfig.from_file(rules) if rules else AbuseConfig()
    store = open_state_file(settings.state_dir, keys_file=getattr(settings, "state_keys_file", None),
                            cluster_token=cluster_token, registry=registry)
    monitor = AbuseMonitor(config, usage_store, AbuseMetrics(registry), store=store)
    return monitor, build_abuse_router(monitor, settings.admin_token, cluster_token, on_refused)


__all__ = ["build_abuse"]
