"""Traces (``GET /admin/v1/traces``) as a list and as one request's waterfall (the Traces page).

    frame = traces_frame([t for t in traces if is_chat_trace(t)])
    spans, events = waterfall_frames(trace)

Called by admin_ui/screens/traces.py. Pure functions, no Streamlit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from admin_ui.views.read import mapping, num

SERVICE_SHORT = {"switchboard-gateway": "gateway", "switchboard-shard": "shard", "switchboard-cache": "cache",
                 "switchboard-cache-node": "cache", "switchboard-control-plane": "control-plane"}


def short_service(name: Any) -> str:
    text = str(name or "?")
    return SERVICE_SHORT.get(text, text.removeprefix("switchboard-"))


def is_chat_trace(trace: Mapping[str, Any]) -> bool:
    """A finished user request: the trace holds the gateway's own ``gateway.request`` span.

    Spans reach the ring when they end, so a request still streaming shows up as loose children
    (``ratelimit``, ``router.route``…) until its ``gateway.request`` span closes; those, and the
    control plane's own work (admin calls, autoscaler ticks), are left out."""
    spans = trace.get("spans")
    if isinstance(spans, list) and spans:
        return any(isinstance(s, Mapping) and s.get("name") == "gateway.request" for s in spans)
    return str(trace.get("root", "")) == "gateway.request"


def _error_type(trace: Mapping[str, Any]) -> str:
    """The ``error.type`` the gateway put on the request's span (``rate_limit_exceeded``, ...), or ""."""
    for span in trace.get("spans") or []:
        if isinstance(span, Mapping) and span.get("name") == "gateway.request":
            return str(mapping(span.get("attributes")).get("error.type") or "")
    return ""


def _status(trace: Mapping[str, Any]) -> str:
    """``ok``, ``error (its error.type)``, or ``ok (1 leg failed)``: a request the platform recovered (a
    shard lost mid-stream, the reply resumed elsewhere) is ok for its client, and the operator still
    sees why its waterfall holds a red span. A bare "error" made a 429 look like an outage until its
    waterfall was opened."""
    if trace.get("status") == "error":
        why = _error_type(trace)
        return f"error ({why})" if why else "error"
    failed = int(num(trace.get("failed_spans")) or 0)
    return f"ok ({failed} leg{'s' if failed > 1 else ''} failed)" if failed else "ok"


def traces_frame(traces: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per trace, most recent first."""
    rows = []
    for t in traces:
        rows.append({
            "time": pd.Timestamp(num(t.get("start")) or 0, unit="s", tz="UTC"),
            "status": _status(t),
            "tier": t.get("tier") or "—",
            "root": t.get("root", ""),
            "duration_ms": num(t.get("duration_ms")),
            "spans": t.get("span_count") or len(t.get("spans") or []),
            "services": ", ".join(short_service(s) for s in t.get("services") or []),
            "trace_id": t.get("trace_id", ""),
        })
    return pd.DataFrame(rows, columns=["time", "status", "tier", "root", "duration_ms", "spans", "services",
                                       "trace_id"])


def waterfall_frames(trace: Mapping[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(spans, events) of one trace, offsets in ms from the trace's start, spans in tree order
    (each child under its parent, siblings by start) with an indented label."""
    spans = [s for s in trace.get("spans") or [] if isinstance(s, Mapping)]
    if not spans:
        return pd.DataFrame(), pd.DataFrame()
    t0 = min(int(s.get("start_ns") or 0) for s in spans)
    by_id = {s.get("span_id"): s for s in spans}
    children: dict[Any, list[Mapping[str, Any]]] = {}
    for s in spans:
        parent = s.get("parent_span_id") if s.get("parent_span_id") in by_id else None
        children.setdefault(parent, []).append(s)
    ordered: list[tuple[int, Mapping[str, Any]]] = []

    def walk(parent: Any, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: int(s.get("start_ns") or 0)):
            ordered.append((depth, s))
            walk(s.get("span_id"), depth + 1)

    walk(None, 0)
    rows, events = [], []
    for i, (depth, s) in enumerate(ordered):
        start = (int(s.get("start_ns") or t0) - t0) / 1e6
        end_ns = s.get("end_ns")
        end = (int(end_ns) - t0) / 1e6 if end_ns else start
        attrs = mapping(s.get("attributes"))
        label = f"{i:02d} {'  ' * depth}{s.get('name', '?')}"
        rows.append({
            "row": label,
            "order": i,
            "name": s.get("name", "?"),
            "service": short_service(s.get("service")),
            "start_ms": start,
            "end_ms": max(end, start + 0.05),  # a zero-length span still shows as a sliver
            "duration_ms": end - start,
            "status": s.get("status", ""),
            "detail": ", ".join(f"{k}={v}" for k, v in list(attrs.items())[:8]),
        })
        for e in s.get("events") or []:
            if isinstance(e, Mapping) and e.get("time_ns"):
                events.append({"row": label, "event": e.get("name", "?"), "at_ms": (int(e["time_ns"]) - t0) / 1e6})
    return pd.DataFrame(rows), pd.DataFrame(events, columns=["row", "event", "at_ms"])
