"""Admin-API answers -> what a page shows: tiles, tables, chart data. Pure functions, no Streamlit.

    latest, history = split_signals(admin.signals())
    tiles = overview_tiles(latest, history, degradation)
    frame = members_frame(admin.members()["members"], latest, now=time.time())

The admin API is young and some endpoints are still being written, so every reader here is
lenient: a missing field is shown as unknown ("—"), never as zero, and never raises.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

TIER_FIELDS = ("priority", "rpm", "tpm", "max_context_tokens", "max_output_tokens", "replication", "shed_order",
               "safety")
"""Columns of the tier policy, in the order of ``data_plane.tiers.Tier``."""


# -- small readers ---------------------------------------------------------------------------------

def num(value: Any) -> float | None:
    """A finite float, or None for anything unknown (None, NaN, text)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def ms(seconds: Any) -> float | None:
    """Seconds -> milliseconds, unknown staying unknown."""
    v = num(seconds)
    return None if v is None else v * 1000


def first(data: Mapping[str, Any] | None, *keys: str) -> Any:
    """The first of `keys` present (and not None) in `data`."""
    if not isinstance(data, Mapping):
        return None
    for key in keys:
        if data.get(key) is not None:
            return data[key]
    return None


def mapping(value: Any) -> Mapping[str, Any]:
    """`value` if it is a mapping, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def items(data: Any, *keys: str) -> list[Any]:
    """A list found at one of `keys` (or `data` itself when it is a list)."""
    if isinstance(data, list):
        return data
    value = first(data, *keys)
    return value if isinstance(value, list) else []


def fmt_seconds(value: Any) -> str:
    v = num(value)
    if v is None:
        return "—"
    if v < 1.0:
        return f"{v * 1000:.0f} ms"
    return f"{v:.2f} s"


def fmt_ms(value: Any) -> str:
    v = num(value)
    return "—" if v is None else (f"{v:.0f} ms" if v < 10_000 else f"{v / 1000:.1f} s")


def fmt_pct(value: Any, digits: int = 1) -> str:
    v = num(value)
    return "—" if v is None else f"{v * 100:.{digits}f} %"


def fmt_rate(value: Any, unit: str) -> str:
    v = num(value)
    if v is None:
        return "—"
    return f"{v:.1f} {unit}" if v < 100 else f"{v:,.0f} {unit}"


def fmt_age(seconds: Any) -> str:
    v = num(seconds)
    if v is None:
        return "—"
    if v < 60:
        return f"{v:.1f} s ago"
    if v < 3600:
        return f"{v / 60:.0f} min ago"
    return f"{v / 3600:.1f} h ago"


def fmt_time(unix: Any) -> str:
    v = num(unix)
    return "—" if v is None else time.strftime("%H:%M:%S", time.localtime(v))


# -- signals ---------------------------------------------------------------------------------------

def split_signals(payload: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``GET /admin/v1/signals`` -> (latest reading, history oldest first).

    Accepts ``{"latest": {...}, "history": [...]}`` as well as a bare reading."""
    if not isinstance(payload, Mapping):
        return {}, []
    latest = first(payload, "latest", "signals", "current")
    history = [h for h in items(payload, "history", "recent") if isinstance(h, Mapping)]
    if not isinstance(latest, Mapping):
        latest = payload if "at" in payload or "shards" in payload else (history[-1] if history else {})
    history = sorted(history, key=lambda h: num(first(h, "at", "ts", "time")) or 0.0)
    return dict(latest), [dict(h) for h in history]


@dataclass(frozen=True)
class SignalsView:
    """The overload figures of one reading (``GET /admin/v1/signals`` ``latest``), read by attribute.

        sig = SignalsView.from_api(latest)
        sig.queue_time_p95_s, sig.ttft_excess_p95_s, sig.complete, sig.missing

    The console reads only the admin API, so it keeps its own copy of the field names
    (``control_plane.signals.model.Signals``); a field the API no longer sends (renamed, removed) makes
    the view incomplete and is named in ``missing``, instead of showing as an empty, calm figure.
    """

    healthy_shards: float | None
    waiting_per_shard: float | None
    load_per_shard: float | None
    capacity_per_shard: float | None
    batch_usage: float | None
    kv_usage: float | None
    queue_time_p95_s: float | None
    ttft_excess_p95_s: float | None
    prefill_p95_s: float | None
    ttft_p95_s: float | None
    complete: bool
    missing: tuple[str, ...]

    @classmethod
    def from_api(cls, reading: Mapping[str, Any] | None) -> SignalsView:
        data = mapping(reading)
        names = [f for f in cls.__dataclass_fields__ if f not in ("complete", "missing")]
        absent = tuple(f"field {name!r} absent from the signals" for name in names if name not in data)
        missing = tuple(str(m) for m in items(data, "missing")) + absent
        values = {name: num(data.get(name)) for name in names}
        complete = bool(data) and data.get("complete") is True and not absent
        return cls(complete=complete, missing=missing if data else ("no signals read yet",), **values)


def qps(reading: Mapping[str, Any]) -> float | None:
    """Requests per second at the gateways: the reading's own figure, or the sum of tier demand."""
    direct = num(first(reading, "qps", "requests_per_s"))
    if direct is not None:
        return direct
    demand = reading.get("demand_by_tier") if isinstance(reading, Mapping) else None
    if isinstance(demand, Mapping) and demand:
        values = [num(v) for v in demand.values()]
        return sum(v for v in values if v is not None)
    return None


@dataclass(frozen=True)
class Tile:
    label: str
    value: str
    help: str
    series: list[float] = field(default_factory=list)
    """Sparkline points (oldest first); empty when there is no history for this figure."""
    status: str = "ok"
    """``ok`` | ``warn`` | ``bad`` | ``unknown`` (no value now) | ``absent`` (not in the signals)."""


def _series(history: Sequence[Mapping[str, Any]], getter: Any) -> list[float]:
    out = []
    for h in history:
        v = getter(h)
        if v is not None:
            out.append(v)
    return out


def _ttft(h: Mapping[str, Any], q: str) -> float | None:
    return num(first(h, f"ttft_{q}_s", f"ttft_{q}"))


def overview_tiles(latest: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                   degradation: Mapping[str, Any] | None, *, ttft_slo_s: float = 1.0) -> list[Tile]:
    """The SLO tiles of the Overview page, each with its sparkline from the signal history."""
    q = qps(latest)
    p50, p95 = _ttft(latest, "p50"), _ttft(latest, "p95")
    tpot = num(first(latest, "tpot_s", "itl_s", "inter_token_latency_s"))
    err = num(latest.get("error_rate")) if latest else None
    tps = num(latest.get("tokens_per_s")) if latest else None
    healthy = num(latest.get("healthy_shards")) if latest else None
    shards = [s for s in items(latest, "shards") if isinstance(s, Mapping)]
    level = num(first(degradation, "level")) if degradation else None
    pinned = bool(first(degradation, "pinned")) if degradation else False

    def status(value: float | None, warn: float, bad: float, *keys: str) -> str:
        if value is None:
            if keys and latest and not any(k in latest for k in keys):
                return "absent"  # this control plane's signals do not carry the figure at all
            return "unknown"
        return "bad" if value > bad else "warn" if value > warn else "ok"

    tiles = [
        Tile("Requests / s", fmt_rate(q, "req/s"), "Chat requests arriving at the gateways (all tiers, all outcomes).",
             _series(history, qps), "unknown" if q is None else "ok"),
        Tile("TTFT p50", fmt_seconds(p50), "Median time to first token over the signal window.",
             _series(history, lambda h: _ttft(h, "p50")),
             status(p50, ttft_slo_s * 0.5, ttft_slo_s, "ttft_p50_s", "ttft_p50")),
        Tile("TTFT p95", fmt_seconds(p95), f"95th percentile time to first token (SLO {ttft_slo_s:g} s).",
             _series(history, lambda h: _ttft(h, "p95")), status(p95, ttft_slo_s * 0.8, ttft_slo_s)),
        Tile("TPOT", fmt_seconds(tpot), "Time per output token (inter-token latency).",
             _series(history, lambda h: num(first(h, "tpot_s", "itl_s", "inter_token_latency_s"))),
             status(tpot, 0.1, 0.25, "tpot_s", "itl_s", "inter_token_latency_s")),
        Tile("Error rate", fmt_pct(err, 2), "Share of gateway requests answered 5xx over the window.",
             _series(history, lambda h: num(h.get("error_rate"))), status(err, 0.01, 0.05)),
        Tile("Tokens / s", fmt_rate(tps, "tok/s"), "Completion tokens streamed per second.",
             _series(history, lambda h: num(h.get("tokens_per_s"))), "unknown" if tps is None else "ok"),
        Tile("Degradation", "—" if level is None else f"L{level:.0f}" + (" (pinned)" if pinned else ""),
             "Degradation ladder level in force (0 normal … 4 enterprise only); pinned = held by an operator.",
             [], "unknown" if level is None else ("ok" if level == 0 else "warn" if level <= 2 else "bad")),
        Tile("Healthy shards", "—" if healthy is None else f"{healthy:.0f} / {len(shards) or healthy:.0f}",
             "Passing (routable) shards out of all registered shards.",
             _series(history, lambda h: num(h.get("healthy_shards"))),
             "unknown" if healthy is None else ("bad" if healthy == 0 else
                                                "warn" if shards and healthy < len(shards) else "ok")),
    ]
    return tiles


def signals_frame(history: Sequence[Mapping[str, Any]], columns: Mapping[str, Any]) -> pd.DataFrame:
    """History as a time-indexed frame with one column per ``{name: getter}``."""
    rows = []
    for h in history:
        t = num(first(h, "at", "ts", "time"))
        if t is None:
            continue
        rows.append({"time": pd.Timestamp(t, unit="s", tz="UTC"), **{name: get(h) for name, get in columns.items()}})
    frame = pd.DataFrame(rows, columns=["time", *columns])
    return frame.set_index("time") if not frame.empty else frame


# -- cluster ---------------------------------------------------------------------------------------

def members_frame(members: Sequence[Mapping[str, Any]], latest: Mapping[str, Any] | None, *,
                  now: float) -> pd.DataFrame:
    """Every member with its health, load, KV usage and heartbeat age (shard figures from signals)."""
    by_id = {str(s.get("member_id") or s.get("id")): s for s in items(latest or {}, "shards") if isinstance(s, Mapping)}
    rows = []
    for m in members:
        meta = mapping(m.get("meta"))
        sig = mapping(by_id.get(str(m.get("id"))))
        running, waiting = num(sig.get("running")), num(sig.get("waiting"))
        slots = num(sig.get("max_num_seqs")) or num(meta.get("max_num_seqs"))
        load = None if running is None or waiting is None else running + waiting
        util = None if load is None or not slots else min(load / slots, 1.0)
        detail = ", ".join(f"{k}={meta[k]}" for k in ("model", "engine", "backend") if meta.get(k))
        hb = num(m.get("last_heartbeat"))
        kv_bytes = num(sig.get("prefix_cache_bytes"))
        rows.append({
            "member": m.get("id", "?"),
            "service": m.get("service", "?"),
            "zone": str(m.get("zone") or meta.get("zone") or "local"),
            "status": str(m.get("status") or ("draining" if m.get("draining") else "unknown")),
            "running": running,
            "waiting": waiting,
            "slots": slots,
            "utilisation": util,
            "kv_usage": num(sig.get("kv_usage")),
            "prefix_hit_rate": num(sig.get("prefix_hit_rate")),
            "prefix_cache_mib": None if kv_bytes is None else kv_bytes / 2**20,
            "ttft_p95_ms": ms(sig.get("ttft_p95_s")),
            "heartbeat_s": None if hb is None else max(0.0, now - hb),
            "ttl_s": num(m.get("ttl_s")),
            "url": m.get("url", ""),
            "detail": detail,
            "problem": sig.get("error") or "",
        })
    order = {"shard": 0, "gateway": 1, "cache": 2}
    frame = pd.DataFrame(rows, columns=["member", "service", "zone", "status", "running", "waiting", "slots", "utilisation",
                                        "kv_usage", "prefix_hit_rate", "prefix_cache_mib", "ttft_p95_ms", "heartbeat_s",
                                        "ttl_s", "url", "detail", "problem"])
    if not frame.empty:
        frame = frame.sort_values(by=["service", "member"], key=lambda c: c.map(order) if c.name == "service" else c)
    return frame.reset_index(drop=True)


def status_counts(members: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """``{service: {status: n}}``."""
    out: dict[str, dict[str, int]] = {}
    for m in members:
        svc = out.setdefault(str(m.get("service", "?")), {})
        st = str(m.get("status", "unknown"))
        svc[st] = svc.get(st, 0) + 1
    return out


# -- tiers -----------------------------------------------------------------------------------------

def tiers_frame(policy: Mapping[str, Any]) -> pd.DataFrame:
    """``{"tiers": {name: {...}}}`` -> one row per tier (column ``tier`` first), highest priority first."""
    tiers = policy.get("tiers") if isinstance(policy, Mapping) else None
    rows = []
    for name, spec in (tiers or {}).items():
        if isinstance(spec, Mapping):
            rows.append({"tier": name, **{f: spec.get(f) for f in TIER_FIELDS}})
    frame = pd.DataFrame(rows, columns=["tier", *TIER_FIELDS])
    if not frame.empty:
        frame = frame.sort_values("priority", kind="stable")
    return frame.reset_index(drop=True)


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA or value == ""


def policy_from_frame(frame: pd.DataFrame) -> dict[str, Any]:
    """The edited table back into the PUT body; numbers as ints, blanks left out (the server says
    which field is missing). Rows without a tier name are dropped."""
    tiers: dict[str, Any] = {}
    for _, row in frame.iterrows():
        name = row.get("tier")
        if _blank(name):
            continue
        spec: dict[str, Any] = {}
        for f in TIER_FIELDS:
            value = row.get(f)
            if _blank(value):
                continue
            if f == "safety":
                spec[f] = str(value)
            else:
                v = num(value)
                spec[f] = int(v) if v is not None and v == int(v) else value
        tiers[str(name).strip()] = spec
    return {"tiers": tiers}


def local_policy_problems(policy: Mapping[str, Any]) -> list[str]:
    """Obvious mistakes caught before the PUT (the server validates again and has the last word)."""
    tiers = policy.get("tiers") if isinstance(policy, Mapping) else None
    if not isinstance(tiers, Mapping) or not tiers:
        return ["the policy needs at least one tier"]
    problems = []
    for name, spec in tiers.items():
        if not isinstance(spec, Mapping):
            problems.append(f"tier {name!r} must be a mapping of fields")
            continue
        for f in ("rpm", "tpm", "max_context_tokens", "max_output_tokens"):
            v = num(spec.get(f))
            if v is not None and v <= 0:
                problems.append(f"{name}.{f} must be > 0 (got {spec.get(f)})")
        rep = num(spec.get("replication"))
        if rep is not None and not 1 <= rep <= 5:
            problems.append(f"{name}.replication must be 1..5 (got {spec.get('replication')})")
    return problems


def frame_problems(frame: pd.DataFrame) -> list[str]:
    """Table-level mistakes: unnamed or duplicate tiers."""
    names = [str(n).strip() for n in frame.get("tier", pd.Series(dtype=object)) if not _blank(n)]
    problems = []
    if len(names) < len(frame):
        problems.append("every row needs a tier name")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"duplicate tier names: {', '.join(dupes)}")
    return problems


def tier_traffic_frame(latest: Mapping[str, Any], policy_tiers: Iterable[str] = ()) -> pd.DataFrame:
    """Per tier: demand, rejections and shed (req/s) over the signal window."""
    demand = mapping(latest.get("demand_by_tier"))
    rejected = mapping(latest.get("rejections_by_tier"))
    shed = mapping(first(latest, "shed_by_tier"))
    names = list(dict.fromkeys([*policy_tiers, *demand, *rejected, *shed]))
    rows = []
    for name in names:
        d, r = num(demand.get(name)), num(rejected.get(name))
        rows.append({"tier": name, "requests_per_s": d, "rejected_per_s": r,
                     "shed_per_s": num(shed.get(name)) if shed else None,
                     "rejected_share": (r / d) if d and r is not None else None})
    return pd.DataFrame(rows, columns=["tier", "requests_per_s", "rejected_per_s", "shed_per_s", "rejected_share"])


def tier_history_frame(history: Sequence[Mapping[str, Any]], key: str) -> pd.DataFrame:
    """Long frame (time, tier, value) of one per-tier map over the history, for a stacked chart."""
    rows = []
    for h in history:
        t = num(first(h, "at", "ts"))
        per = h.get(key)
        if t is None or not isinstance(per, Mapping):
            continue
        for tier, v in per.items():
            if num(v) is not None:
                rows.append({"time": pd.Timestamp(t, unit="s", tz="UTC"), "tier": tier, "value": num(v)})
    return pd.DataFrame(rows, columns=["time", "tier", "value"])


# -- alerts ----------------------------------------------------------------------------------------

def alert_rows(payload: Any) -> list[dict[str, Any]]:
    """Alerts as rows (name, state, severity, summary, since, labels), firing first."""
    rows = []
    raw = items(payload, "alerts", "items")
    if isinstance(payload, Mapping) and not raw:
        for state in ("firing", "pending", "resolved", "recent"):
            for a in items(payload, state):
                if isinstance(a, Mapping):
                    raw.append({"state": "resolved" if state == "recent" else state, **a})
    for a in raw:
        if not isinstance(a, Mapping):
            continue
        labels = mapping(a.get("labels"))
        annotations = mapping(a.get("annotations"))
        rows.append({
            "state": _alert_state(first(a, "state", "status")),
            "name": str(first(a, "name", "alertname") or labels.get("alertname") or "?"),
            "severity": str(first(a, "severity") or labels.get("severity") or ""),
            "summary": str(first(a, "summary", "message", "description") or annotations.get("summary")
                           or annotations.get("description") or ""),
            "since": num(first(a, "since", "active_at", "activeAt", "started_at", "at")),
            "resolved_at": num(first(a, "resolved_at", "ended_at")),
            "value": first(a, "value"),
            "labels": ", ".join(f"{k}={v}" for k, v in labels.items() if k not in ("alertname", "severity")),
        })
    rank = {"firing": 0, "pending": 1}
    rows.sort(key=lambda r: (rank.get(r["state"], 2), -(r["since"] or 0)))
    return rows


def _alert_state(value: Any) -> str:
    state = str(value or "firing").lower()
    return "firing" if state in ("firing", "active") else state


# -- autoscaler ------------------------------------------------------------------------------------



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


# -- traces ----------------------------------------------------------------------------------------

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


def traces_frame(traces: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per trace, most recent first."""
    rows = []
    for t in traces:
        rows.append({
            "time": pd.Timestamp(num(t.get("start")) or 0, unit="s", tz="UTC"),
            "status": "error" if t.get("status") == "error" else "ok",
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
