"""Alerts: what is firing now, and what fired recently (as seen by this console).

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import threading
import time

import pandas as pd
import streamlit as st

from admin_ui import ui
from admin_ui.views.alerts import alert_rows
from admin_ui.views.read import fmt_age, fmt_time

ui.header("Alerts", "Firing alerts from Alertmanager or Prometheus when configured, else the control plane's "
                    "built-in checks.")




class AlertMemory:
    """Alerts seen firing by this console process, kept after they stop (``recent``)."""

    def __init__(self, keep: int = 200) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], dict] = {}
        self._keep = keep

    def update(self, firing: list[dict], now: float) -> list[dict]:
        with self._lock:
            current = {(a["name"], a["labels"]): a for a in firing}
            for key, a in current.items():
                entry = self._seen.setdefault(key, {**a, "first_seen": now})
                entry.update(a, last_seen=now, resolved_at=None)
            for key, entry in self._seen.items():
                if key not in current and entry.get("resolved_at") is None:
                    entry["resolved_at"] = now
            resolved = [e for e in self._seen.values() if e.get("resolved_at") is not None]
            resolved.sort(key=lambda e: e["resolved_at"], reverse=True)
            for stale in resolved[self._keep:]:
                self._seen.pop((stale["name"], stale["labels"]), None)
            return resolved[: self._keep]


@st.cache_resource(show_spinner=False)
def _memory() -> AlertMemory:
    return AlertMemory()


def _frame(rows: list[dict], resolved: bool = False) -> pd.DataFrame:
    return pd.DataFrame([{
        "severity": r["severity"] or "—",
        "alert": r["name"],
        "summary": r["summary"],
        "since": fmt_time(r["since"] or r.get("first_seen")),
        **({"resolved": fmt_time(r.get("resolved_at"))} if resolved else
           {"for": fmt_age(time.time() - (r["since"] or r.get("first_seen") or time.time())).replace(" ago", "")}),
        "labels": r["labels"],
    } for r in rows])


@ui.live("alerts")
def body(c: ui.Console) -> None:
    payload = ui.fetch("Alerts", c.admin.alerts)
    if payload is None:
        return
    rows = alert_rows(payload)
    firing = [r for r in rows if r["state"] == "firing"]
    source = payload.get("source", "?")
    st.caption(f"Source: **{source}**")
    if payload.get("error"):
        st.warning(f"The configured alert source failed, showing built-in checks: {payload['error']}", icon=":material/warning:")
    recent = _memory().update(firing, time.time())
    crit = sum(1 for r in firing if r["severity"] == "critical")
    warn = sum(1 for r in firing if r["severity"] == "warning")
    cols = st.columns(3)
    cols[0].metric("Firing", len(firing), border=True, delta="all clear" if not firing else None,
                   delta_color="green", delta_arrow="off")
    cols[1].metric("Critical", crit, border=True)
    cols[2].metric("Warning", warn, border=True)

    st.subheader("Firing now", divider="red" if crit else "orange" if firing else "green")
    if not firing:
        st.success("Nothing is firing.", icon=":material/check_circle:")
    else:
        st.dataframe(ui.colour_words(_frame(firing), ["severity"]), hide_index=True, placeholder="—", width="stretch",
                     column_config={"summary": st.column_config.TextColumn("Summary", width="large")})
    st.subheader("Recently resolved", divider="gray")
    if not recent:
        # The console notices a resolve only by watching: an alert that fired and cleared while no one had
        # this page open (a shard killed and restarted) left no trace, and "since this console started"
        # claimed otherwise. Alertmanager / Prometheus keep the history.
        st.caption("Nothing seen to stop firing while this page was open. Alerts that fired and cleared with "
                   "the page closed are not listed: Prometheus / Alertmanager keep that history.")
    else:
        st.dataframe(_frame(recent, resolved=True), hide_index=True, placeholder="—", width="stretch")


body()
