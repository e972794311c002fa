"""Recent traces across processes, assembled from every process's ``/debug/spans`` ring.

Called by the admin API's ``GET /admin/v1/traces`` (control_plane/admin/api.py), which the console's
Traces page reads.

    spans, sources = await collect_spans(members, http)         # members' rings + this process's
    traces = assemble_traces(spans)                             # most recent first
    [t for t in traces if not is_housekeeping(t["root"])]       # drop heartbeats, scrapes, polls

Each process keeps its finished spans in memory (``data_plane.common.telemetry.RECENT_SPANS``) unless
an OTLP collector takes them; this is what lets the console show a waterfall with nothing else
installed. A member that does not answer is named in ``sources`` and left out, never fatal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from data_plane.common.telemetry import RECENT_SPANS

SPANS_TIMEOUT_S = 1.5
TIER_ATTRIBUTE = "switchboard.tier"
SELF = "control-plane"
HOUSEKEEPING_ROUTES = ("/health", "/metrics", "/debug/spans", "/v1/registry/", "/v1/state")
"""Traces rooted at a server span on these routes (heartbeats, scrapes, state polls) are routine:
every process's HTTP server makes them by the thousand."""


def is_housekeeping(root_name: str) -> bool:
    """True for a server span like ``PUT /v1/registry/members/{member_id}`` or ``GET /metrics``."""
    _, _, route = root_name.partition(" ")
    return route.startswith(HOUSEKEEPING_ROUTES)


async def collect_spans(
    members: Iterable[Mapping[str, Any]], http: httpx.AsyncClient | None, trace_id: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """This process's spans plus those of every member not critical (registry member dicts),
    fetched concurrently; returns the spans and ``{source: "ok" | why it is missing}``.
    `headers`: the cluster token members' ``/debug/spans`` require (data_plane/common/hop_auth.py)."""
    sources: dict[str, str] = {SELF: "ok"}
    spans = list(RECENT_SPANS.snapshot(trace_id))

    async def fetch(member: Mapping[str, Any]) -> list[dict[str, Any]]:
        if http is None:
            sources[member["id"]] = "no http client"
            return []
        params = {"trace_id": trace_id} if trace_id else None
        try:
            resp = await http.get(member["url"] + "/debug/spans", params=params, timeout=SPANS_TIMEOUT_S,
                                  headers=dict(headers or {}))
            resp.raise_for_status()
            body = resp.json()
            if not isinstance(body, list):
                raise TypeError("not a list")
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            sources[member["id"]] = f"{type(exc).__name__}: {str(exc)[:120]}"
            return []
        sources[member["id"]] = "ok"
        return [s for s in body if isinstance(s, dict) and s.get("trace_id") and s.get("span_id")]

    live = [m for m in members if m.get("status") != "critical"]
    for found in await asyncio.gather(*(fetch(m) for m in live)):
        spans.extend(found)
    return spans, sources


def assemble_traces(spans: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Group span dicts (as served at ``/debug/spans``) into traces, most recent first.

    A trace's ``duration_ms`` and ``status`` are its root span's (the gateway's ``gateway.request``:
    what the client got), not the union of every span: after a mid-stream failover the abandoned
    shard's ``shard.generate`` ends in error up to the stall's length later, and a request that was
    delivered whole in 6 s must not be listed as a 21 s error. ``failed_spans`` counts the spans
    that ended in error (a failed leg the request recovered from shows as ``ok`` with a count).
    Without its root (not collected, or still open) a trace spans all it has, an error if any is.

    assemble_traces([{"trace_id": "a"*32, "span_id": "1"*16, "parent_span_id": None, "name": "gateway.request",
                      "service": "switchboard-gateway", "start_ns": 1, "end_ns": 2, "status": "OK",
                      "attributes": {"switchboard.tier": "free"}, "events": []}])[0]["tier"]   # 'free'
    """
    by_trace: dict[str, dict[str, dict[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(str(span["trace_id"]), {})[str(span["span_id"])] = dict(span)
    traces: list[dict[str, Any]] = []
    for trace_id, by_id in by_trace.items():
        ordered = sorted(by_id.values(), key=lambda s: (s.get("start_ns") or 0, s.get("name", "")))
        roots = [s for s in ordered if not s.get("parent_span_id") or s["parent_span_id"] not in by_id]
        root = roots[0] if roots else ordered[0]
        failed = sum(1 for s in ordered if s.get("status") == "ERROR")
        if not root.get("parent_span_id") and root.get("end_ns"):
            # The request as its caller saw it: a shard leg abandoned after a failover ends (in error)
            # whenever that shard notices, long after the resumed reply was delivered.
            start, end = int(root.get("start_ns") or 0), int(root["end_ns"])
            status = "error" if root.get("status") == "ERROR" else "ok"
        else:  # root not collected (yet): the spans we have are all there is to go on
            start = min(s.get("start_ns") or 0 for s in ordered)
            end = max((s.get("end_ns") or s.get("start_ns") or 0) for s in ordered)
            status = "error" if failed else "ok"
        tier = next(
            (s["attributes"][TIER_ATTRIBUTE] for s in ordered if TIER_ATTRIBUTE in (s.get("attributes") or {})),
            None,
        )
        traces.append({
            "trace_id": trace_id,
            "root": str(root.get("name", "")),
            "services": sorted({str(s.get("service", "")) for s in ordered}),
            "start": start / 1e9,
            "duration_ms": round((end - start) / 1e6, 3),
            "status": status,
            "failed_spans": failed,
            "tier": str(tier) if tier is not None else None,
            "span_count": len(ordered),
            "spans": ordered,
        })
    traces.sort(key=lambda t: t["start"], reverse=True)
    return traces
