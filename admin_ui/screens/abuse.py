"""Abuse: what the usage monitor flagged and what the gateways are doing about it; lift or confirm.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``: ``/admin/v1/abuse``) and draws what admin_ui/views/abuse.py computes.
The control plane's rules and thresholds: control_plane/abuse/model.py.
"""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from admin_ui import ui
from admin_ui.views.abuse import RESPONSES, action_rows, ended_rows, event_rows, response_counts

ui.header("Abuse", "Keys and addresses departing from their usual use (bursts past their baseline, blocked "
                   "prompts, session id probing, repeated invalid keys) and the response in force for each. "
                   "Every response expires by itself; lift one that is wrong, confirm one that is right.")


def _lift(action_id: int) -> None:
    c = ui.console()
    ui.act(f"Lift action {action_id}", lambda: c.admin.lift_abuse(action_id), about=f"abuse {action_id}")


def _confirm(action_id: int) -> None:
    c = ui.console()
    ui.act(f"Confirm action {action_id}", lambda: c.admin.confirm_abuse(action_id), about=f"abuse {action_id}")


@ui.live("abuse")
def body(c: ui.Console) -> None:
    ui.show_flash()
    payload = ui.fetch("Abuse", c.admin.abuse)
    if payload is None:
        return
    actions = payload.get("actions", [])
    counts = response_counts(actions)
    cols = st.columns(len(RESPONSES) + 1)
    pending = sum(1 for a in actions if a["review"] == "pending")
    cols[0].metric("Awaiting review", pending, border=True)
    for col, name in zip(cols[1:], RESPONSES):
        col.metric(name.capitalize(), counts[name], border=True)

    st.subheader("In force", divider="orange" if actions else "green")
    if not actions:
        st.success("Nothing flagged: every key and address is within its usual use.", icon=":material/check_circle:")
    for row in action_rows(actions, time.time(), payload.get("config")):
        with st.container(border=True):
            left, right = st.columns([5, 1])
            left.markdown(f"**{row['response'].upper()}** · {row['subject']} · tenant {row['tenant']} · "
                          f"*{row['rule']}* · review: **{row['review']}**")
            left.caption(f"{row['why']} · since {row['since']} · expires {row['expires']}")
            left.caption(f"Gateways: {row['effect']}")
            right.button("Lift", key=f"lift-{row['id']}", icon=":material/undo:", on_click=_lift, args=(row["id"],))
            if row["review"] == "pending":
                right.button("Confirm", key=f"confirm-{row['id']}", icon=":material/verified:", on_click=_confirm,
                             args=(row["id"],))

    st.subheader("Recent events", divider="gray")
    events = event_rows(payload.get("events", [])[:50])
    if events:
        st.dataframe(pd.DataFrame(events), hide_index=True, placeholder="—", width="stretch")
    else:
        st.caption("No rule has fired since the control plane started.")
    ended = ended_rows(payload.get("ended", [])[:50])
    if ended:
        st.subheader("Ended", divider="gray")
        st.dataframe(pd.DataFrame(ended), hide_index=True, placeholder="—", width="stretch")
    with st.expander("Thresholds"):
        st.json(payload.get("config", {}))


body()
