"""Traces: recent requests (filter by tier, status, latency) and one trace's spans as a waterfall.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from admin_ui import ui
from admin_ui.client import ConsoleError
from admin_ui.views.read import fmt_ms, fmt_time, items
from admin_ui.views.tiers import tier_filter_choices
from admin_ui.views.traces import is_chat_trace, short_service, traces_frame, waterfall_frames

ui.header("Traces", "Recent requests assembled from every process's spans (one trace per chat request).")

ANY = "any"
wanted = st.query_params.get("trace")
if wanted and st.session_state.get("_trace_from_url") != wanted:
    st.session_state["_trace_from_url"] = wanted
    st.session_state["trace_pick"] = wanted


def _tier_choices() -> list[str]:
    """The tiers of the policy in force (an operator's own too: a fixed free/plus/enterprise list could not
    filter a tier added on Traffic & tiers), as the Usage page's filter."""
    try:
        policy = ui.console().admin.tiers()
    except ConsoleError:
        policy = None
    return tier_filter_choices(policy, st.session_state.get("trace_tier"), ANY)


CHAT, ALL = "chat requests", "everything"
f0, f1, f2, f3, f4 = st.columns([1.2, 1, 1, 1, 1])
f0.selectbox("Show", [CHAT, ALL], key="trace_kind",
             help="Chat requests: finished traces with a gateway.request span. Everything adds requests still "
                  "in flight (their spans so far) and the control plane's own work (admin calls, autoscaler ticks).")
f1.selectbox("Tier", _tier_choices(), key="trace_tier")
f2.selectbox("Status", [ANY, "ok", "error"], key="trace_status")
f3.number_input("Slower than (ms)", min_value=0, value=0, step=50, key="trace_min_ms")
f4.number_input("Show at most", min_value=5, max_value=200, value=25, step=5, key="trace_limit")


def _waterfall(spans: pd.DataFrame, events: pd.DataFrame) -> alt.LayerChart:
    order = list(spans["row"])
    y = alt.Y("row:N", sort=order, title=None, axis=alt.Axis(labelLimit=320, labelFontSize=12))
    bars = alt.Chart(spans).mark_bar(cornerRadius=2, height={"band": 0.7}).encode(
        x=alt.X("start_ms:Q", title="ms since the request arrived"),
        x2="end_ms:Q",
        y=y,
        color=alt.Color("service:N", title="process", scale=alt.Scale(scheme="tableau10")),
        tooltip=["name:N", "service:N", alt.Tooltip("start_ms:Q", format=".1f", title="start (ms)"),
                 alt.Tooltip("duration_ms:Q", format=".1f", title="duration (ms)"), "status:N", "detail:N"],
    )
    labels = alt.Chart(spans).mark_text(align="left", dx=4, fontSize=11, color="#444").encode(
        x="end_ms:Q", y=y, text=alt.Text("duration_ms:Q", format=".1f"))
    layers = [bars, labels]
    if not events.empty:
        layers.append(alt.Chart(events).mark_tick(color="black", thickness=2, size=16).encode(
            x="at_ms:Q", y=alt.Y("row:N", sort=order), tooltip=["event:N", alt.Tooltip("at_ms:Q", format=".1f")]))
    return alt.layer(*layers).properties(height=alt.Step(24))  # type: ignore[return-value]


@ui.live("traces")
def body(c: ui.Console) -> None:
    tier = st.session_state.get("trace_tier", ANY)
    status = st.session_state.get("trace_status", ANY)
    limit = int(st.session_state.get("trace_limit", 25))
    chat_only = st.session_state.get("trace_kind", CHAT) == CHAT
    payload = ui.fetch("Traces", lambda: c.admin.traces(
        limit=200 if chat_only else limit, tier=None if tier == ANY else tier,
        status=None if status == ANY else status, min_ms=float(st.session_state.get("trace_min_ms", 0)) or None))
    if payload is None:
        return
    traces = [t for t in items(payload, "traces") if isinstance(t, dict)]
    if chat_only:
        traces = [t for t in traces if is_chat_trace(t)][:limit]
    broken = {k: v for k, v in (payload.get("sources") or {}).items() if v != "ok"}
    if broken:
        st.warning("Spans missing from: " + "; ".join(f"**{k}** ({v})" for k, v in broken.items()), icon=":material/extension_off:")
    if not traces:
        st.info("No traces match. Send some traffic (e.g. from the Playground) or loosen the filters.", icon=":material/search:")
    else:
        st.dataframe(ui.colour_words(traces_frame(traces), ["status"]), hide_index=True, placeholder="—", width="stretch",
                     height=min(36 + 35 * len(traces), 360), column_config={
            "time": st.column_config.DatetimeColumn("When", format="HH:mm:ss.SSS"),
            "status": st.column_config.TextColumn("Status", width="medium"),  # "ok (1 leg failed)"
            "tier": st.column_config.TextColumn("Tier", width="small"),
            "root": st.column_config.TextColumn("Root span"),
            "duration_ms": st.column_config.NumberColumn("Latency", format="%.1f ms"),
            "spans": st.column_config.NumberColumn("Spans", format="%d"),
            "services": st.column_config.TextColumn("Processes"),
            "trace_id": st.column_config.TextColumn("Trace id"),
        })

    by_id = {t["trace_id"]: t for t in traces}
    picked = st.session_state.get("trace_pick")
    if picked and picked not in by_id:
        one = ui.fetch("Trace", lambda: c.admin.traces(trace_id=picked, limit=1))
        for t in items(one, "traces"):
            by_id[t["trace_id"]] = t
    if not by_id:
        return
    options = list(by_id)

    def label(tid: str) -> str:
        t = by_id[tid]
        return (f"{fmt_time(t.get('start'))} · {t.get('root')} · {t.get('tier') or '—'} · "
                f"{fmt_ms(t.get('duration_ms'))} · {t.get('status')} · {tid[:12]}…")

    st.subheader("Waterfall", divider="gray")
    choice = st.selectbox("Trace", options, index=options.index(picked) if picked in options else 0,
                          format_func=label)
    st.session_state["trace_pick"] = choice
    trace = by_id[choice]
    spans, events = waterfall_frames(trace)
    st.caption(f"Trace `{choice}` · {trace.get('span_count') or len(spans)} spans across "
               f"{', '.join(short_service(s) for s in trace.get('services') or [])} · "
               f"{fmt_ms(trace.get('duration_ms'))} · ticks mark span events (queue, prefill, decode…)")
    if spans.empty:
        st.caption("This trace has no spans.")
    else:
        st.altair_chart(_waterfall(spans, events), width="stretch")


body()
