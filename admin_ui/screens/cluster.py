"""Cluster: every member with its health, load, KV usage and heartbeat; drain / undrain shards.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it reads only the
admin API (``ui.Console``) and draws what admin_ui/views/ computes.
"""

from __future__ import annotations

import time

import streamlit as st

from admin_ui import ui
from admin_ui.views.cluster import members_frame, processes_frame, stages_frame, status_counts
from admin_ui.views.read import items
from admin_ui.views.signals import split_signals

ui.header("Cluster", "Every registered process. Shard load and KV usage come from the control plane's last scrape.")


def _drain(member_id: str, drain: bool) -> None:
    c = ui.console()
    if drain:
        ui.act(f"Drain {member_id}", lambda: c.admin.drain(member_id), about=f"drain {member_id}")
    else:
        ui.act(f"Undrain {member_id}", lambda: c.admin.undrain(member_id), about=f"drain {member_id}")


def _processes(c: ui.Console) -> None:
    """The table of what `switchboard up` supervises, when the control plane runs under it."""
    procs = processes_frame(ui.fetch("Processes", c.admin.processes, quiet_unavailable=True), now=time.time())
    if not procs.empty:
        st.subheader("Processes (switchboard up)", divider="gray")
        st.caption("What `switchboard up` supervises: a process that died is restarted with backoff; its restarts "
                   "and last exit stay here until `up` stops (`switchboard admin processes`).")
        st.dataframe(ui.colour_words(procs, ["status"]), hide_index=True, placeholder="—", width="stretch", key="processes",
                     column_config={"process": "Process", "pid": st.column_config.NumberColumn("PID", format="%d"),
                                    "status": "State", "up_s": st.column_config.NumberColumn("Up for", format="%.0f s"),
                                    "restarts": st.column_config.NumberColumn("Restarts", format="%d"),
                                    "last_exit": "Last exit", "log": "Log"})


COLUMNS = {
    "member": st.column_config.TextColumn("Member", width="medium"),
    "service": st.column_config.TextColumn("Service", width="small"),
    "zone": st.column_config.TextColumn("Zone", width="small", help="Failure domain (--zone); see docs/ZONES.md"),
    "status": st.column_config.TextColumn("Health", width="small"),
    "running": st.column_config.NumberColumn("Running", format="%d"),
    "waiting": st.column_config.NumberColumn("Waiting", format="%d"),
    "slots": st.column_config.NumberColumn("Slots", format="%d", help="Batch slots (max_num_seqs)"),
    "utilisation": st.column_config.ProgressColumn("Batch load", min_value=0.0, max_value=1.0, format="percent",
                                                   help="(running + waiting) / slots"),
    "kv_usage": st.column_config.ProgressColumn("KV cache", min_value=0.0, max_value=1.0, format="percent"),
    "prefix_hit_rate": st.column_config.ProgressColumn("KV reuse", min_value=0.0, max_value=1.0, format="percent",
                                                       help="Prefix-cache hit rate (prompt tokens) over the window"),
    "prefix_cache_mib": st.column_config.NumberColumn("KV kept", format="%.0f MiB",
                                                      help="KV bytes the shard's prefix cache holds; for a cache node, the "
                                                           "KV blocks it keeps for sessions (announced every 10 s)"),
    "ttft_p95_ms": st.column_config.NumberColumn("TTFT p95", format="%.0f ms"),
    "heartbeat_s": st.column_config.NumberColumn("Heartbeat", format="%.1f s ago"),
    "ttl_s": st.column_config.NumberColumn("TTL", format="%.1f s", help="Heartbeat TTL: critical after this long"),
    "detail": st.column_config.TextColumn("Details"),
    "url": st.column_config.LinkColumn("URL"),
    "problem": st.column_config.TextColumn("Problem"),
}


@ui.live("cluster")
def body(c: ui.Console) -> None:
    ui.show_flash()
    members = ui.fetch("Members", c.admin.members)
    if members is None:
        return
    signals = ui.fetch("Signals", c.admin.signals, quiet_unavailable=True)
    latest, _ = split_signals(signals)
    member_list = items(members, "members")
    if members.get("warming_up"):
        st.info("The registry restarted recently: members are still re-registering.", icon=":material/hourglass_top:")
    if not member_list:
        st.warning("No members registered. Start shards, cache nodes and a gateway (`switchboard up`).", icon=":material/search_off:")
        _processes(c)  # after an outage of everything, what died and how is what the operator came for
        return

    frame = members_frame(member_list, latest, now=time.time())
    counts = status_counts(member_list)
    cols = st.columns(len(counts) or 1)
    for col, (service, by_status) in zip(cols, sorted(counts.items())):
        total = sum(by_status.values())
        passing = by_status.get("passing", 0)
        other = ", ".join(f"{n} {s}" for s, n in sorted(by_status.items()) if s != "passing")
        col.metric(f"{service}s", f"{passing} / {total} passing", delta=other or "all healthy",
                   delta_color="green" if not other else "orange", delta_arrow="off", border=True)

    shown = frame
    if not shown["problem"].astype(bool).any():
        shown = shown.drop(columns=["problem"])
    order = [c for c in ("member", "service", "zone", "status", "heartbeat_s", "running", "waiting", "slots", "utilisation",
                         "kv_usage", "prefix_hit_rate", "prefix_cache_mib", "ttft_p95_ms", "problem", "detail",
                         "ttl_s", "url") if c in shown.columns]
    st.dataframe(ui.colour_words(shown, ["status"]), hide_index=True, column_config=COLUMNS, width="stretch",
                 placeholder="—", column_order=order)

    stages = stages_frame(member_list)
    if not stages.empty:
        st.subheader("Pipeline stages", divider="gray")
        st.caption("Shards split over stage processes (--pipeline-parallel-size): each stage's host and layers. "
                   "Losing one moves the shard's streams elsewhere and restarts the whole group (docs/SHARDING.md).")
        st.dataframe(ui.colour_words(stages, ["status"]), hide_index=True, placeholder="—", width="stretch", key="pipeline-stages",
                     column_config={"member": "Shard", "status": "Health", "stage": "Stage", "host": "Host",
                                    "layers": "Layers", "role": "Holds"})

    _processes(c)

    shards = [m for m in member_list if m.get("service") == "shard"]
    if shards:
        st.subheader("Shard actions", divider="gray")
        st.caption("Draining stops new requests to a shard; in-flight requests finish. Undrain puts it back.")
        for m in sorted(shards, key=lambda m: str(m.get("id"))):
            mid, status = str(m.get("id")), str(m.get("status"))
            a, b, d = st.columns([3, 2, 2], vertical_alignment="center")
            a.markdown(f"**{mid}** · {ui.badge(status, ui.STATUS_COLORS.get(status, 'gray'))}")
            b.caption(m.get("url", ""))
            if m.get("draining") or status == "draining":
                d.button("Undrain", key=f"undrain-{mid}", icon=":material/play_arrow:", on_click=_drain,
                         args=(mid, False), width="stretch")
            else:
                d.button("Drain", key=f"drain-{mid}", icon=":material/pause:", on_click=_drain, args=(mid, True),
                         width="stretch", type="secondary")


body()
