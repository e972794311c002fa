"""Overview: the platform's SLOs at a glance, with sparklines from the signal history.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import streamlit as st

from admin_ui import ui
from admin_ui.views.alerts import alert_rows
from admin_ui.views.cluster import idle_caption, members_frame, status_counts
from admin_ui.views.read import items, num
from admin_ui.views.signals import overview_tiles, split_signals
from admin_ui.views.tiers import tier_history_frame

ui.header("Overview", "Service-level figures over the control plane's signal window, refreshed live.")


@ui.live("overview")
def body(c: ui.Console) -> None:
    signals = ui.fetch("Signals", c.admin.signals)
    degradation = ui.fetch("Degradation", c.admin.degradation, quiet_unavailable=True)
    members = ui.fetch("Members", c.admin.members)
    alerts = ui.fetch("Alerts", c.admin.alerts, quiet_unavailable=True)
    latest, history = split_signals(signals)
    member_list = items(members, "members")

    _status_strip(latest, degradation, member_list, alerts)
    ui.tiles(overview_tiles(latest, history, degradation))

    if latest and not latest.get("complete", True):
        missing = ", ".join(str(m) for m in items(latest, "missing")) or "unknown"
        st.warning(f"**Signals incomplete** — the autoscaler and the ladder hold still until they are whole. "
                   f"Missing: {missing}", icon=":material/warning:")

    left, right = st.columns(2)
    with left:
        st.subheader("Demand by tier", divider="gray")
        demand = tier_history_frame(history, "demand_by_tier")
        if demand.empty:
            st.caption("No per-tier demand yet (no gateway traffic in the window).")
        else:
            st.altair_chart(ui.tier_chart(demand, stacked=True, height=220), width="stretch")
    with right:
        st.subheader("Load per shard", divider="gray")
        frame = members_frame([m for m in member_list if m.get("service") == "shard"], latest, now=0)
        if frame.empty:
            st.caption("No shards registered.")
        elif (idle := idle_caption(frame)) is not None:
            # all zero: Vega draws an empty plot with one tick labelled "0.000000"; say it in words
            st.caption(idle)
        else:
            chart = frame.set_index("member")[["running", "waiting"]].fillna(0)
            st.bar_chart(chart, horizontal=True, stack=True, y_label="", x_label="requests", height=220,
                         color=["#2e7d32", "#f9a825"])


def _status_strip(latest: dict, degradation: dict | None, members: list, alerts: dict | None) -> None:
    counts = status_counts(members)
    parts = []
    for service in ("shard", "cache", "gateway"):
        c = counts.get(service, {})
        total = sum(c.values())
        passing = c.get("passing", 0)
        color = "gray" if total == 0 else "green" if passing == total else "red" if passing == 0 else "orange"
        parts.append(ui.badge(f"{service}s {passing}/{total} passing", color))
    if degradation is not None:
        level = int(num(degradation.get("level")) or 0)
        label = ui.LEVEL_LABELS.get(level, str(level))
        pin = " · pinned" if degradation.get("pinned") else ""
        parts.append(ui.badge(f"degradation L{level} {label}{pin}", ui.LEVEL_COLORS.get(level, "gray")))
    if alerts is not None:
        firing = [a for a in alert_rows(alerts) if a["state"] == "firing"]
        parts.append(ui.badge(f"{len(firing)} alert{'' if len(firing) == 1 else 's'} firing", "red" if firing else "green"))
    if latest:
        parts.append(ui.badge("signals complete" if latest.get("complete", True) else "signals incomplete",
                              "green" if latest.get("complete", True) else "orange"))
    st.markdown(" ".join(parts))


body()
