"""The autoscaler's decision log and "replicas over time against demand" (the Autoscaler page).

    frame = decisions_frame(admin.decisions())          # newest first, the inputs that mattered as columns
    chart = replicas_frame(history, decisions)          # long frame (time, series, value, axis)

Called by admin_ui/screens/autoscaler.py. Pure functions, no Streamlit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from admin_ui.views.read import first, mapping, ms, num
from admin_ui.views.signals import qps


def decisions_frame(decisions: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The decision log, newest first, with the inputs that mattered as columns."""
    rows = []
    for d in decisions:
        inputs = mapping(d.get("inputs"))
        at, last = num(d.get("at")), num(d.get("last_at"))
        action = str(d.get("action", "?"))
        frm, to = d.get("from"), d.get("to")
        rows.append({
            "time": pd.Timestamp(last or at or 0, unit="s", tz="UTC"),
            "action": action,
            "replicas": "—" if frm is None and to is None else (f"{frm} → {to}" if frm != to else f"{frm}"),
            "repeats": int(num(d.get("repeats")) or 1),
            "reason": str(d.get("reason", "")),
            "outcome": str(d.get("outcome", "")),
            "waiting_per_shard": num(inputs.get("waiting_per_shard")),
            "ttft_p95_ms": ms(inputs.get("ttft_p95_s")),
            "load_per_shard": num(inputs.get("load_per_shard")),
            "healthy_shards": num(inputs.get("healthy_shards")),
            "qps": qps(inputs),
            "complete": inputs.get("complete"),
        })
    frame = pd.DataFrame(rows, columns=["time", "action", "replicas", "repeats", "reason", "outcome",
                                        "waiting_per_shard", "ttft_p95_ms", "load_per_shard", "healthy_shards",
                                        "qps", "complete"])
    return frame.iloc[::-1].reset_index(drop=True)


def replicas_frame(history: Sequence[Mapping[str, Any]], decisions: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Long frame (time, series, value, axis) for "replicas over time against demand":
    healthy shards and in-flight load from the signal history, desired replicas from decisions."""
    rows: list[dict[str, Any]] = []

    def add(t: float | None, series: str, value: float | None, axis: str) -> None:
        if t is not None and value is not None:
            rows.append({"time": pd.Timestamp(t, unit="s", tz="UTC"), "series": series, "value": value, "axis": axis})

    for h in history:
        t = num(first(h, "at", "ts"))
        healthy = num(h.get("healthy_shards"))
        add(t, "healthy shards", healthy, "replicas")
        per, cap = num(h.get("load_per_shard")), num(h.get("capacity_per_shard"))
        if healthy is not None and per is not None:
            add(t, "in-flight requests", per * healthy, "load")
        if healthy is not None and cap is not None:
            add(t, "batch slots", cap * healthy, "load")
        add(t, "requests/s", qps(h), "load")
    for d in decisions:
        for t in (num(d.get("at")), num(d.get("last_at"))):
            add(t, "desired replicas", num(d.get("to")), "replicas")
    return pd.DataFrame(rows, columns=["time", "series", "value", "axis"])
