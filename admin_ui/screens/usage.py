"""Usage: requests and tokens from the usage ledger, per tenant and per tier, with a CSV download.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

from admin_ui import ui
from admin_ui.client import ConsoleError
from admin_ui.views.tiers import tier_filter_choices

ui.header("Usage", "One record per request from the usage ledger (GET /admin/v1/usage): tokens and requests by "
                   "tenant and tier. Records reach the database in batches, about a second after the request.")

ANY = "any"
RANGES = {"last 24 hours": 86400, "last 7 days": 7 * 86400, "last 30 days": 30 * 86400}
TOKENS = ["prompt_tokens", "completion_tokens", "cached_tokens"]
# The records table's headers: the tiles' words, not the ledger's column names. (A comment: Streamlit's
# magic draws a bare string under a constant on the page.)
RECORD_COLUMNS = {"time": "When (UTC)", "tenant": "Tenant", "tier": "Tier", "requests": "Requests", "errors": "Errors",
                  "prompt_tokens": "Prompt tokens", "completion_tokens": "Completion tokens",
                  "cached_tokens": "Cached tokens"}



def _policy() -> dict | None:
    """The tier policy in force, for the Tier filter (None when it cannot be read: the page says why below)."""
    try:
        return ui.console().admin.tiers()
    except ConsoleError:
        return None


f0, f1, f2, f3, f4 = st.columns([1.2, 1, 1, 1, 1])
f0.selectbox("Range", list(RANGES), index=1, key="usage_range")
f1.selectbox("Bucket", ["hour", "day"], key="usage_bucket")
f2.selectbox("Tier", tier_filter_choices(_policy(), st.session_state.get("usage_tier"), ANY), key="usage_tier")
f3.text_input("Tenant", key="usage_tenant", placeholder="any")
f4.text_input("Key id", key="usage_key", placeholder="any", help="A key's short SHA-256 digest, as in the ledger.")


NO_TENANT = "(no valid key)"


def usage_frame(rows: list[dict]) -> pd.DataFrame:
    """Ledger rows -> one row per bucket x tenant x tier, with a `time` column and a token total."""
    frame = pd.DataFrame(rows, columns=["start", "tenant", "tier", "requests", "errors", *TOKENS])
    # A request refused before its key was known (401) has no tenant: say so, rather than draw a
    # nameless series and a blank cell beside the "unknown" tier.
    frame["tenant"] = frame["tenant"].fillna("").replace("", NO_TENANT)
    frame["time"] = pd.to_datetime(frame["start"], unit="s", utc=True)
    frame["tokens"] = frame["prompt_tokens"] + frame["completion_tokens"]
    return frame


def _chart(frame: pd.DataFrame, by: str) -> alt.Chart:
    return alt.Chart(frame).mark_bar().encode(
        x=ui.time_x(), y=alt.Y("sum(tokens):Q", title="tokens (prompt + completion)"),
        color=alt.Color(f"{by}:N", title=by), tooltip=["time:T", f"{by}:N", "sum(tokens):Q", "sum(requests):Q"],
    ).properties(height=260)


@ui.live("usage")
def body(c: ui.Console) -> None:
    now = time.time()
    tier = st.session_state.get("usage_tier", ANY)
    filters = {"start": now - RANGES[st.session_state.get("usage_range", "last 7 days")], "end": now,
               "group_by": st.session_state.get("usage_bucket", "hour"), "by": "tenant,tier",
               "tier": None if tier == ANY else tier, "tenant": (st.session_state.get("usage_tenant") or "").strip(),
               "key": (st.session_state.get("usage_key") or "").strip(),
               "limit": st.session_state.get("usage_row_limit")}  # unset: the API's own (10,000 rows)
    payload = ui.fetch("Usage", lambda: c.admin.usage(**filters))
    if payload is None:
        return
    totals = payload.get("totals") or {}
    cols = st.columns(5)
    cols[0].metric("Requests", f"{totals.get('requests', 0):,}", border=True)
    cols[1].metric("Errors", f"{totals.get('errors', 0):,}", border=True)
    cols[2].metric("Prompt tokens", f"{totals.get('prompt_tokens', 0):,}", border=True)
    cols[3].metric("Cached tokens", f"{totals.get('cached_tokens', 0):,}", border=True)
    cols[4].metric("Completion tokens", f"{totals.get('completion_tokens', 0):,}", border=True)
    rows = payload.get("rows") or []
    if not rows and payload.get("truncated"):  # the API keeps whole buckets: the newest alone was over the limit
        st.warning("No rows shown: the newest bucket alone has more rows than one answer holds (the totals above "
                   "cover the whole range). Filter by tier, tenant or key id, or pick hour buckets.",
                   icon=":material/warning:")
        return
    if not rows:
        st.info("No usage recorded in this range. Send some traffic (e.g. from the Playground) or widen the range.",
                icon=":material/receipt_long:")
        return
    if payload.get("truncated"):
        st.warning("Only the newest buckets are shown: the range has more rows than one answer holds (the totals "
                   "above cover all of it). Narrow the range, or pick day buckets.", icon=":material/warning:")
    frame = usage_frame(rows)
    left, right = st.columns(2)
    with left:
        st.subheader("Per tenant", divider="gray")
        st.altair_chart(_chart(frame, "tenant"), width="stretch")
    with right:
        st.subheader("Per tier", divider="gray")
        st.altair_chart(_chart(frame, "tier"), width="stretch")
    st.subheader("Records by bucket", divider="gray")
    shown = frame.assign(time=frame["time"].dt.strftime("%Y-%m-%d %H:%M"))
    st.dataframe(shown[["time", "tenant", "tier", "requests", "errors", *TOKENS]].iloc[::-1], hide_index=True,
                 placeholder="—", width="stretch", column_config=RECORD_COLUMNS)
    csv = ui.fetch("Usage CSV", lambda: c.admin.usage_csv(**filters))
    if csv is not None:
        st.download_button("Download CSV", csv, file_name="switchboard-usage.csv", mime="text/csv",
                           icon=":material/download:", key="usage_csv")


body()
