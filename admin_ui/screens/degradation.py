"""Degradation: the ladder's level, why it is there, its history; pin a level or release it.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

from admin_ui import ui
from admin_ui.views.read import fmt_age, fmt_time, items, num

ui.header("Degradation", "0 normal → 1 shrink context → 2 cap output → 3 shed free tier → 4 enterprise only. "
                         "Raised and lowered automatically with hysteresis unless an operator pins a level.")

VERDICT_COLORS = {"hot": "red", "hold": "orange", "calm": "green", "incomplete": "gray"}


def _ladder(level: int) -> None:
    cols = st.columns(5)
    for rung, col in enumerate(cols):
        active = rung == level
        color = ui.LEVEL_COLORS[rung] if active else "gray"
        with col.container(border=True):
            st.markdown(f"{'**' if active else ''}:{color}[L{rung}]{'**' if active else ''}  \n"
                        f"{':' + color + '[' if active else ''}{ui.LEVEL_LABELS[rung]}{']' if active else ''}")
            st.caption("◀ in force" if active else " ")


@ui.live("degradation")
def body(c: ui.Console) -> None:
    ui.show_flash()
    d = ui.fetch("Degradation", c.admin.degradation)
    if d is None:
        return
    level = int(num(d.get("level")) or 0)
    pinned = bool(d.get("pinned"))
    since = num(d.get("since"))
    head = f"## :{ui.LEVEL_COLORS.get(level, 'gray')}[Level {level} — {ui.LEVEL_LABELS.get(level, d.get('name'))}]"
    st.markdown(head + (" &nbsp; :orange-badge[:material/push_pin: pinned by operator]" if pinned else
                        " &nbsp; :blue-badge[automatic]"))
    st.markdown(f"**Why:** {d.get('reason') or '—'}  \n"
                f"**Since:** {fmt_time(since)} ({fmt_age(time.time() - since if since else None)})")
    _ladder(level)

    auto = d.get("automatic") or {}
    verdict = str(auto.get("verdict", "?"))
    reasons = "; ".join(str(r) for r in auto.get("reasons") or []) or "—"
    st.markdown(f"**Automatic rule:** {ui.badge(verdict, VERDICT_COLORS.get(verdict, 'gray'))} {reasons}  \n"
                f"calm for {num(auto.get('calm_for_s')) or 0:.0f} s · level held for "
                f"{num(auto.get('held_for_s')) or 0:.0f} s · dwell up {auto.get('raise_dwell_s', '?')} s / "
                f"down {auto.get('lower_dwell_s', '?')} s" + (" · *ignored while pinned*" if pinned else ""))

    history = [e for e in items(d, "history") if isinstance(e, dict)]
    st.subheader("History", divider="gray")
    if not history:
        st.caption("No level changes yet.")
        return
    frame = pd.DataFrame([{
        "time": pd.Timestamp(num(e.get("at")) or 0, unit="s", tz="UTC"),
        "change": f"L{e.get('from')} → L{e.get('to')}",
        "level": e.get("to"),
        "actor": str(e.get("actor", "")) + (" (pin)" if e.get("pinned") else ""),
        "reason": e.get("reason", ""),
    } for e in history])
    steps = pd.concat([frame[["time", "level"]],
                       pd.DataFrame({"time": [pd.Timestamp.now(tz="UTC")], "level": [level]})])
    chart = alt.Chart(steps).mark_line(interpolate="step-after", point=True).encode(
        x=ui.time_x(),
        y=alt.Y("level:Q", title="level", scale=alt.Scale(domain=[0, 4]), axis=alt.Axis(tickCount=5)),
    ).properties(height=160)
    st.altair_chart(chart, width="stretch")
    st.dataframe(ui.colour_words(frame.iloc[::-1], ["actor"]), hide_index=True, placeholder="—", width="stretch", column_config={
        "time": st.column_config.DatetimeColumn("When", format="HH:mm:ss"),
        "change": st.column_config.TextColumn("Change", width="small"),
        "level": None,
        "actor": st.column_config.TextColumn("By", width="small"),
        "reason": st.column_config.TextColumn("Reason", width="large"),
    })


body()

# -- operator controls (outside the live region) ---------------------------------------------------

st.subheader("Operator override", divider="gray")
c = ui.console()


def _pin() -> None:
    reason = str(st.session_state.get("pin_reason") or "").strip()
    if not reason:
        ui.flash("error", "Say why you pin the level: the reason goes into the history.", about="pin")
        return
    level = int(st.session_state["pin_level"])
    if ui.act(f"Pin level {level}", lambda: c.admin.pin_degradation(level, reason), about="pin"):
        st.session_state["pin_reason"] = ""


def _release() -> None:
    ui.act("Release the pin", c.admin.release_degradation, about="pin")


left, right = st.columns([3, 1])
with left:
    st.selectbox("Level to hold", options=list(ui.LEVEL_LABELS), key="pin_level",
                 format_func=lambda n: f"L{n} — {ui.LEVEL_LABELS[n]}")
    st.text_input("Reason (kept in the history)", key="pin_reason", placeholder="e.g. incident 4711: GPU pool down")
with right:
    st.button("Pin level", type="primary", icon=":material/push_pin:", on_click=_pin, width="stretch")
    st.button("Release pin", icon=":material/lock_open:", on_click=_release, width="stretch",
              help="The level in force stays; the automatic rule takes over from it, one step at a time.")
