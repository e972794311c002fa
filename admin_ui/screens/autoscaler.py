"""Autoscaler: replicas over time against demand, and the decision log with inputs and reasons.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import altair as alt
import streamlit as st

from admin_ui import ui
from admin_ui.views.decisions import decisions_frame, replicas_frame
from admin_ui.views.read import fmt_seconds, items, num
from admin_ui.views.signals import SignalsView, split_signals

ui.header("Autoscaler", "Target tracking on waiting requests per shard, queue time p95 and TTFT beyond prefill "
                        "p95 against the SLO, only under pressure. Fast up, slow down; never acts on incomplete "
                        "signals.")


def _replicas_chart(frame) -> alt.LayerChart:
    base = alt.Chart(frame).encode(x=ui.time_x())
    replicas = base.transform_filter(alt.datum.axis == "replicas").mark_line(interpolate="step-after", strokeWidth=3).encode(
        y=alt.Y("value:Q", title="replicas", axis=alt.Axis(tickMinStep=1)),
        color=alt.Color("series:N", title=None, scale=alt.Scale(
            domain=["healthy shards", "desired replicas", "in-flight requests", "batch slots", "requests/s"],
            range=["#1565c0", "#6a1b9a", "#ef6c00", "#9e9e9e", "#2e7d32"])),
        strokeDash=alt.condition(alt.datum.series == "desired replicas", alt.value([6, 3]), alt.value([1, 0])),
        tooltip=["time:T", "series:N", "value:Q"],
    )
    load = base.transform_filter(alt.datum.axis == "load").mark_line(opacity=0.8).encode(
        y=alt.Y("value:Q", title="load (requests, req/s)"),
        color="series:N",
        tooltip=["time:T", "series:N", alt.Tooltip("value:Q", format=".2f")],
    )
    return alt.layer(replicas, load).resolve_scale(y="independent").properties(height=260)


@ui.live("autoscaler")
def body(c: ui.Console) -> None:
    payload = ui.fetch("Decisions", c.admin.decisions)
    signals = ui.fetch("Signals", c.admin.signals, quiet_unavailable=True)
    latest, history = split_signals(signals)
    decisions = [d for d in items(payload, "decisions") if isinstance(d, dict)]
    running = payload.get("autoscaler", True) if isinstance(payload, dict) else None
    if running is False:
        st.info("No autoscaler runs on this control plane (start it with `--autoscale`). "
                "Replica counts below are what the registry sees.", icon=":material/info:")

    last = decisions[-1] if decisions else {}
    cols = st.columns(5)
    healthy = num(latest.get("healthy_shards"))
    cols[0].metric("Healthy shards", "—" if healthy is None else f"{healthy:.0f}", border=True)
    desired = num(last.get("to"))
    cols[1].metric("Desired", "—" if desired is None else f"{desired:.0f}", border=True,
                   delta=None if not last else str(last.get("action")), delta_arrow="off",
                   delta_color={"scale_up": "orange", "scale_down": "blue", "error": "red"}.get(  # type: ignore[arg-type]
                       str(last.get("action")), "gray"))
    sig = SignalsView.from_api(latest)
    waiting = sig.waiting_per_shard
    cols[2].metric("Waiting / shard", "—" if waiting is None else f"{waiting:.1f}", border=True,
                   help="Mean queued requests per passing shard: the target-tracking input.")
    load, cap = sig.load_per_shard, sig.capacity_per_shard
    cols[3].metric("Load / shard", "—" if load is None else f"{load:.1f}" + (f" / {cap:.0f}" if cap else ""),
                   border=True, help="Mean running + waiting requests per passing shard / its batch slots.")
    cols[4].metric("TTFT p95", fmt_seconds(sig.ttft_p95_s), border=True,
                   delta=f"beyond prefill {fmt_seconds(sig.ttft_excess_p95_s)}", delta_arrow="off",
                   delta_color="gray",
                   help="Raw TTFT grows with the prompt (prefill) and is never acted on; the autoscaler and the "
                        "ladder read TTFT beyond prefill and the queue time, with a queue or busy batches.")
    st.caption(f"Queue time p95 {fmt_seconds(sig.queue_time_p95_s)} · batches "
               f"{'—' if sig.batch_usage is None else f'{sig.batch_usage:.0%}'} full · KV "
               f"{'—' if sig.kv_usage is None else f'{sig.kv_usage:.0%}'}: what overload means here.")
    if latest and not sig.complete:
        st.warning("Signals incomplete: the autoscaler and the ladder hold. " + "; ".join(sig.missing)[:400],
                   icon=":material/warning:")

    st.subheader("Replicas against demand", divider="gray")
    frame = replicas_frame(history, decisions)
    if frame.empty:
        st.caption("No history yet: the chart fills as the control plane reads signals.")
    else:
        st.altair_chart(_replicas_chart(frame), width="stretch")

    st.subheader("Decision log", divider="gray")
    st.toggle("Every tick (with hold / steady)", key="decisions_every_tick",
              help="Off: only scaling actions and errors, plus the latest decision.")
    if not decisions:
        st.caption("No decisions recorded yet.")
        return
    every_tick = st.session_state.get("decisions_every_tick", False)
    shown = decisions if every_tick else [d for d in decisions[:-1] if d.get("action") not in ("hold", "steady")] + [
        decisions[-1]]
    table = decisions_frame(shown).drop(columns=["healthy_shards"])
    st.dataframe(ui.colour_words(table, ["action"]), hide_index=True, width="stretch", placeholder="—",
                 column_config={
        "time": st.column_config.DatetimeColumn("When", format="HH:mm:ss"),
        "action": st.column_config.TextColumn("Action", width="small"),
        "replicas": st.column_config.TextColumn("Replicas", width="small"),
        "repeats": st.column_config.NumberColumn("×", help="Identical consecutive decisions folded into one"),
        "reason": st.column_config.TextColumn("Reason", width=520),
        "outcome": st.column_config.TextColumn("Outcome", width="small"),
        "waiting_per_shard": st.column_config.NumberColumn("Waiting/shard", format="%.1f"),
        "ttft_p95_ms": st.column_config.NumberColumn("TTFT p95", format="%.0f ms"),
        "load_per_shard": st.column_config.NumberColumn("Load/shard", format="%.1f"),
        "qps": st.column_config.NumberColumn("Demand", format="%.2f req/s"),
        "complete": st.column_config.CheckboxColumn("Signals whole"),
    })


body()
