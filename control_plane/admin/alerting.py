"""Firing alerts for the admin API: from Alertmanager or Prometheus when configured, else a few
built-in checks evaluated in-process, so a console without a monitoring stack still warns.

Called by the admin API's ``GET /admin/v1/alerts`` (control_plane/admin/api.py), which the console's
Alerts and Overview pages read.

    alerts = await fetch_alerts(http, alertmanager_url=None, prometheus_url="http://127.0.0.1:9090")
    alerts = builtin_alerts(members, warming_up=False, degradation=store.degradation, signals=latest)

Every alert has one shape: ``{name, severity, state, summary, labels, active_at}`` (unix seconds
or None). Alertmanager (its active, unsilenced, uninhibited alerts) is preferred to Prometheus
(its firing rules) when both are set; if the configured source fails, the built-in checks answer
and ``error`` says why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import httpx

from control_plane.policy_store import DegradationRecord
from data_plane.common.ladder import Level

log = logging.getLogger(__name__)

ALERTS_TIMEOUT_S = 3.0


async def fetch_alerts(
    http: httpx.AsyncClient, *, alertmanager_url: str | None, prometheus_url: str | None
) -> tuple[str, list[dict[str, Any]] | None, str | None]:
    """``(source, alerts, error)`` from the configured source; alerts None when it failed or none is set."""
    if alertmanager_url:
        source, url, fetch = "alertmanager", alertmanager_url, _alertmanager_alerts
    elif prometheus_url:
        source, url, fetch = "prometheus", prometheus_url, _prometheus_alerts
    else:
        return "builtin", None, None
    try:
        return source, await fetch(http, url), None
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        error = f"{source} at {url}: {type(exc).__name__}: {str(exc)[:200]}"
        log.warning("alerts: %s; answering with the built-in checks", error)
        return "builtin", None, error


async def _prometheus_alerts(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    resp = await http.get(url.rstrip("/") + "/api/v1/alerts", timeout=ALERTS_TIMEOUT_S)
    resp.raise_for_status()
    body = resp.json()
    if body.get("status") != "success":
        raise ValueError(f"prometheus answered {body.get('status')}: {body.get('error')}")
    out = []
    for alert in body["data"]["alerts"]:
        if alert.get("state") != "firing":
            continue
        out.append(_external_alert(alert.get("labels") or {}, alert.get("annotations") or {}, "firing",
                                   alert.get("activeAt")))
    return out


async def _alertmanager_alerts(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    params = {"active": "true", "silenced": "false", "inhibited": "false"}
    resp = await http.get(url.rstrip("/") + "/api/v2/alerts", params=params, timeout=ALERTS_TIMEOUT_S)
    resp.raise_for_status()
    body = resp.json()
    if not isinstance(body, list):
        raise TypeError("expected a list of alerts")
    return [
        _external_alert(a.get("labels") or {}, a.get("annotations") or {},
                        (a.get("status") or {}).get("state", "active"), a.get("startsAt"))
        for a in body
    ]


def _external_alert(labels: Mapping[str, Any], annotations: Mapping[str, Any], state: str,
                    active_at: str | None) -> dict[str, Any]:
    return {
        "name": str(labels.get("alertname", "unnamed")),
        "severity": str(labels.get("severity", "warning")),
        "state": state,
        "summary": str(annotations.get("summary") or annotations.get("description") or ""),
        "labels": {str(k): str(v) for k, v in labels.items()},
        "annotations": {str(k): str(v) for k, v in annotations.items()},
        "active_at": _unix(active_at),
    }


def _unix(rfc3339: str | None) -> float | None:
    if not rfc3339:
        return None
    try:
        return datetime.fromisoformat(rfc3339).timestamp()
    except ValueError:
        return None


def builtin_alerts(
    members: Iterable[Mapping[str, Any]],
    *,
    warming_up: bool,
    degradation: DegradationRecord,
    signals: Any,
) -> list[dict[str, Any]]:
    """The in-process checks: no healthy shard, degradation from shedding up, critical members, blind signals."""
    out: list[dict[str, Any]] = []
    members = list(members)
    shards = [m for m in members if m["service"] == "shard"]
    if not warming_up and not any(m["status"] == "passing" for m in shards):
        out.append(_alert("SwitchboardNoHealthyShard", "critical",
                          f"no shard passes its health check ({len(shards)} known): chat requests fail with 503"))
    level = degradation.level
    if level >= Level.SHED_FREE_TIER:
        severity = "critical" if level >= Level.ENTERPRISE_ONLY else "warning"
        out.append(_alert("SwitchboardDegraded", severity,
                          f"degradation level {int(level)} ({level.label}): {degradation.reason}",
                          {"level": str(int(level))}, active_at=degradation.since))
    critical = sorted(m["id"] for m in members if m["status"] == "critical")
    if critical:
        shown = ", ".join(critical[:10]) + (f" and {len(critical) - 10} more" if len(critical) > 10 else "")
        out.append(_alert("SwitchboardMembersCritical", "warning",
                          f"{len(critical)} member(s) missed their heartbeat TTL: {shown}"))
    if signals is not None and not getattr(signals, "complete", True):
        missing = ", ".join(map(str, getattr(signals, "missing", ())))[:300]
        out.append(_alert("SwitchboardSignalsIncomplete", "info",
                          f"signals incomplete, autoscaling and degradation hold: {missing}"))
    return out


def _alert(name: str, severity: str, summary: str, labels: Mapping[str, str] | None = None,
           active_at: float | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "severity": severity,
        "state": "firing",
        "summary": summary,
        "labels": {"alertname": name, "severity": severity, **(labels or {})},
        "active_at": active_at,
    }
