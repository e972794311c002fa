"""Traffic & tiers: per-tier demand, rejections and shedding; the tier policy as an editable table.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import streamlit as st
import yaml

from admin_ui import ui
from admin_ui.client import ConsoleError, Rejected
from admin_ui.views.read import fmt_time
from admin_ui.views.signals import split_signals
from admin_ui.views.tiers import (
    frame_problems,
    local_policy_problems,
    policy_from_frame,
    tier_history_frame,
    tier_traffic_frame,
    tiers_frame,
)

ui.header("Traffic & tiers", "Who is being served, who is being refused, and the one tier policy everything reads.")


@ui.live("traffic")
def body(c: ui.Console) -> None:
    signals = ui.fetch("Signals", c.admin.signals)
    latest, history = split_signals(signals)
    policy = ui.fetch("Tier policy", c.admin.tiers, quiet_unavailable=True) or {}
    loaded = st.session_state.get("tiers_loaded")
    if policy and loaded and policy.get("updated_at") != loaded.get("updated_at"):
        st.warning(f"The tier policy changed on the control plane at {fmt_time(policy.get('updated_at'))} "
                   f"(by {policy.get('source', '?')}) after the editor below loaded it: press **Reload** before "
                   "editing, or Save will overwrite that change.", icon=":material/sync_problem:")
    traffic = tier_traffic_frame(latest, (policy.get("tiers") or {}).keys())
    if traffic.empty:
        st.info("No per-tier traffic in the signal window yet (no gateway requests, or no gateway registered).",
                icon=":material/inbox:")
    else:
        if traffic["shed_per_s"].isna().all():  # this control plane reports shedding only as 503 rejections
            traffic = traffic.drop(columns=["shed_per_s"])
        st.dataframe(traffic, hide_index=True, width="stretch", placeholder="0", column_config={
            "tier": st.column_config.TextColumn("Tier"),
            "requests_per_s": st.column_config.NumberColumn("Requests", format="%.2f req/s"),
            "rejected_per_s": st.column_config.NumberColumn("Rejected (429/503)", format="%.2f req/s"),
            "shed_per_s": st.column_config.NumberColumn("Shed by degradation", format="%.2f req/s",
                                                        help="Not reported separately by this control plane "
                                                             "when empty: shedding shows up as 503 rejections."),
            "rejected_share": st.column_config.ProgressColumn("Rejected share", min_value=0.0, max_value=1.0,
                                                              format="percent"),
        })
    left, right = st.columns(2)
    with left:
        demand = tier_history_frame(history, "demand_by_tier")
        st.caption("Requests per second by tier")
        if demand.empty:
            st.caption("— no history yet —")
        else:
            st.altair_chart(ui.tier_chart(demand, stacked=False, height=200), width="stretch")
    with right:
        rejected = tier_history_frame(history, "rejections_by_tier")
        st.caption("Rejections per second by tier (429 rate limit, 503 shed/overload)")
        if rejected.empty:
            st.caption("— no rejections in the history —")
        else:
            st.altair_chart(ui.tier_chart(rejected, stacked=False, height=200), width="stretch")


body()

# -- the policy editor: outside the live region, so a refresh never wipes an edit in progress -------

st.subheader("Tier policy", divider="gray")
c = ui.console()


def _load() -> None:
    loaded = ui.fetch("Tier policy", c.admin.tiers, quiet_refused=True)  # the banner above says so
    if loaded is not None:
        st.session_state["tiers_loaded"] = loaded
        st.session_state["tiers_editor_version"] = st.session_state.get("tiers_editor_version", 0) + 1


if "tiers_loaded" not in st.session_state and c.admin.health():
    _load()
loaded = st.session_state.get("tiers_loaded")

if loaded is None:
    st.info("The tier policy could not be read (see above); the editor appears once it can.", icon=":material/construction:")
else:
    st.caption(f"In force since {fmt_time(loaded.get('updated_at'))} · source **{loaded.get('source', '?')}** · "
               f"pushed to gateways as state index {loaded.get('state_index', '?')}. Lower priority is served first; "
               "the lowest shed order is shed first.")
    version = st.session_state.get("tiers_editor_version", 0)
    edited = st.data_editor(
        tiers_frame(loaded), key=f"tier_editor_{version}", num_rows="dynamic", hide_index=True,
        width="stretch",
        column_config={
            "tier": st.column_config.TextColumn("Tier", required=True, validate=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"),
            "priority": st.column_config.NumberColumn("Priority", min_value=0, max_value=1000, step=1, required=True),
            "rpm": st.column_config.NumberColumn("RPM / key", min_value=1, step=1, required=True,
                                                 help="Requests per minute per API key"),
            "tpm": st.column_config.NumberColumn("TPM / key", min_value=1, step=1, required=True,
                                                 help="Tokens per minute per API key"),
            "max_context_tokens": st.column_config.NumberColumn("Max context", min_value=1, step=1, required=True,
                                                                format="%d tok"),
            "max_output_tokens": st.column_config.NumberColumn("Max output", min_value=1, step=1, required=True,
                                                               format="%d tok"),
            "replication": st.column_config.NumberColumn("Session replicas", min_value=1, max_value=5, step=1,
                                                         required=True),
            "shed_order": st.column_config.NumberColumn("Shed order", min_value=0, max_value=1000, step=1,
                                                        required=True),
            "safety": st.column_config.TextColumn("Safety policy", default="default"),
        },
    )
    a, b, _ = st.columns([1, 1, 4])
    save = a.button("Save policy", type="primary", icon=":material/save:", width="stretch")
    if b.button("Reload", icon=":material/refresh:", width="stretch"):
        _load()
        st.rerun()

    def _save(policy: dict, table_problems: list[str] | None = None) -> None:
        problems = (table_problems or []) + local_policy_problems(policy)
        if problems:
            st.session_state["tiers_error"] = "Not saved: " + "; ".join(problems)
            return
        try:
            answer = c.admin.put_tiers(policy)
        except Rejected as exc:
            where = f" (field `{exc.param}`)" if exc.param else ""
            st.session_state["tiers_error"] = f"The control plane refused the policy{where}: {exc.message}"
            return
        except ConsoleError as exc:
            st.session_state["tiers_error"] = f"Not saved: {exc.message}"
            return
        st.session_state.pop("tiers_error", None)
        st.session_state["tiers_loaded"] = answer
        st.session_state["tiers_editor_version"] = version + 1
        ui.flash("success", f"Tier policy saved ({', '.join(answer.get('tiers', {}))}); gateways pick it up within "
                            "a second.", about="tiers")
        st.rerun()

    if save:
        _save(policy_from_frame(edited), frame_problems(edited))

    with st.expander("Edit as YAML (paste a whole policy file)"):
        text = st.text_area("Policy YAML", value=yaml.safe_dump({"tiers": loaded.get("tiers", {})}, sort_keys=False),
                            height=260, key=f"tier_yaml_{version}")
        if st.button("Save YAML", icon=":material/upload:"):
            try:
                parsed = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                st.session_state["tiers_error"] = f"Not saved: the YAML does not parse ({exc})"
            else:
                if isinstance(parsed, dict):
                    _save(parsed)
                else:
                    st.session_state["tiers_error"] = "Not saved: the YAML must be a mapping with a `tiers` key"

    if st.session_state.get("tiers_error"):
        st.error(st.session_state["tiers_error"], icon=":material/block:")
    ui.show_flash()
