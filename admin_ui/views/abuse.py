"""What the Abuse page shows, computed from ``GET /admin/v1/abuse`` (no Streamlit here, so tests
read it directly).

    rows = action_rows(payload["actions"], now=time.time(), config=payload["config"])  # one per action in force
    counts = response_counts(payload["actions"])               # {"flag": 1, "block": 1, ...}
"""

from __future__ import annotations

import re
from typing import Any

from admin_ui.views.read import fmt_age, fmt_time

RESPONSES = ("flag", "strict", "throttle", "block", "ban")
"""Mildest first (control_plane/abuse/model.py Response)."""

EFFECTS = {
    "flag": "traffic untouched: listed for review",
    "strict": "its prompts go through the strict input filter, its replies capped at {strict_max_output_tokens} "
              "tokens",
    "throttle": "past {throttle_rpm} requests a minute: 429 abuse_throttled + Retry-After",
    "block": "every request: 429 abuse_blocked + Retry-After",
    "ban": "requests without a valid API key from this address: 403 address_banned + Retry-After (its bad keys "
           "still count); its valid keys are served",
}
"""What the gateways do under each response (data_plane/gateway/abuse.py), said on the page so that an operator
knows what a lift or a confirm changes; ``{field}`` is read from the payload's ``config``."""


def effect(response: str, config: dict[str, Any]) -> str:
    """What the gateways do under `response`, with the thresholds in force (``?`` for one the payload lacks)."""
    text = EFFECTS.get(response, "")
    return re.sub(r"\{(\w+)\}", lambda m: str(config.get(m.group(1), "?")), text)


def action_rows(actions: list[dict[str, Any]], now: float,
                config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per action in force, the strongest responses first; `effect` says what the gateways do."""
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
        "effect": effect(a["response"], config or {}),
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


__all__ = ["EFFECTS", "RESPONSES", "action_rows", "effect", "ended_rows", "event_rows", "response_counts"]
