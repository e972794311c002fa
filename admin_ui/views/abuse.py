"""What the Abuse page shows, computed from ``GET /admin/v1/abuse`` (no Streamlit here, so tests
read it directly).

    rows = action_rows(payload["actions"], now=time.time())   # one row per action in force
    counts = response_counts(payload["actions"])               # {"flag": 1, "block": 1, ...}
"""

from __future__ import annotations

from typing import Any

from admin_ui.views.read import fmt_age, fmt_time

RESPONSES = ("flag", "strict", "throttle", "block", "ban")
"""Mildest first (control_plane/abuse/model.py Response)."""


def action_rows(actions: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """One row per action in force, the strongest responses first."""
    order = {r: i for i, r in enumerate(RESPONSES)}
    rows = [{
        "id": a["id"],
        "response": a["response"],
        "subject": f"{a['subject_kind']} {a['subject']}",
        "tenant": a.get("tenant") or "—",
        "rule": a["rule"].replace("_", " "),
        "why": a["reason"],
        "since": fmt_time(a["created_at"]),
        "expires": "in " + fmt_age(max(0.0, a["expires_at"] - now)).replace(" ago", ""),
        "review": a["review"],
    } for a in actions]
    rows.sort(key=lambda r: (-order.get(r["response"], 0), r["id"]))
    return rows


def response_counts(actions: list[dict[str, Any]]) -> dict[str, int]:
    return {r: sum(1 for a in actions if a["response"] == r) for r in RESPONSES}


def ended_rows(ended: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"response": e["response"], "subject": e["subject"], "rule": e["rule"].replace("_", " "),
             "ended": e["ended"] + (f" by {e['ended_by']}" if e.get("ended_by") else ""),
             "at": fmt_time(e["ended_at"])} for e in ended]


def event_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"at": fmt_time(e["at"]), "rule": e["rule"].replace("_", " "), "subject": e["subject"],
             "step": e["response"], "why": e["reason"]} for e in events]


__all__ = ["RESPONSES", "action_rows", "ended_rows", "event_rows", "response_counts"]
