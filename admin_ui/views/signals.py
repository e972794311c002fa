"""The signal readings as the console shows them: the latest/history split, the overload view, the SLO tiles.

    latest, history = split_signals(admin.signals())
    tiles = overview_tiles(latest, history, degradation)       # the Overview page's tiles
    sig = SignalsView.from_api(latest)                         # the Autoscaler page's overload figures

Called by the pages in admin_ui/screens/ (overview, cluster, traffic, autoscaler) and by
admin_ui/ui.py (which draws the :class:`Tile` list). Pure functions, no Streamlit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from admin_ui.views.read import first, fmt_pct, fmt_rate, fmt_seconds, items, mapping, num


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
