"""Lenient readers and formatters of admin-API values, shared by every view module.

    num("0.25") == 0.25; num(float("nan")) is None; first(reading, "ttft_p95_s", "ttft_p95")
    fmt_seconds(0.25) == "250 ms"; fmt_pct(None) == "—"

Called by the other ``admin_ui.views`` modules and by the pages (admin_ui/screens/*). The admin
API is young and some endpoints are still being written, so every reader here is lenient: a
missing field is unknown ("—"), never zero, and never raises.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any


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
