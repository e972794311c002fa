"""Alerts (``GET /admin/v1/alerts``) as rows, firing first, whatever shape the source answers in.

    rows = alert_rows(admin.alerts())

Called by admin_ui/screens/alerts.py and overview.py. Pure functions, no Streamlit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from admin_ui.views.read import first, items, mapping, num


def alert_rows(payload: Any) -> list[dict[str, Any]]:
    """Alerts as rows (name, state, severity, summary, since, labels), firing first."""
    rows = []
    raw = items(payload, "alerts", "items")
    if isinstance(payload, Mapping) and not raw:
        for state in ("firing", "pending", "resolved", "recent"):
            for a in items(payload, state):
                if isinstance(a, Mapping):
                    raw.append({"state": "resolved" if state == "recent" else state, **a})
    for a in raw:
        if not isinstance(a, Mapping):
            continue
        labels = mapping(a.get("labels"))
        annotations = mapping(a.get("annotations"))
        rows.append({
            "state": _alert_state(first(a, "state", "status")),
            "name": str(first(a, "name", "alertname") or labels.get("alertname") or "?"),
            "severity": str(first(a, "severity") or labels.get("severity") or ""),
            "summary": str(first(a, "summary", "message", "description") or annotations.get("summary")
                           or annotations.get("description") or ""),
            "since": num(first(a, "since", "active_at", "activeAt", "started_at", "at")),
            "resolved_at": num(first(a, "resolved_at", "ended_at")),
            "value": first(a, "value"),
            "labels": ", ".join(f"{k}={v}" for k, v in labels.items() if k not in ("alertname", "severity")),
        })
    rank = {"firing": 0, "pending": 1}
    rows.sort(key=lambda r: (rank.get(r["state"], 2), -(r["since"] or 0)))
    return rows


def _alert_state(value: Any) -> str:
    state = str(value or "firing").lower()
    return "firing" if state in ("firing", "active") else state
