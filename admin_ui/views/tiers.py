"""The tier policy as an editable table and the per-tier traffic figures (the Traffic page).

    frame = tiers_frame(admin.policy())                 # one row per tier, for st.data_editor
    body = policy_from_frame(edited)                    # back into the PUT body
    problems = frame_problems(edited) + local_policy_problems(body)

Called by admin_ui/screens/traffic.py and overview.py. Pure functions, no Streamlit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from admin_ui.views.read import first, mapping, num

TIER_FIELDS = ("priority", "rpm", "tpm", "max_context_tokens", "max_output_tokens", "replication", "shed_order",
               "safety")
"""Columns of the tier policy, in the order of ``data_plane.tiers.Tier``."""


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
    """Long frame (time, tier, value) of one per-tier map over the history, for a stacked chart. A reading
    that lacks a tier seen elsewhere in the history counts it 0 (a reader leaves out a tier with nothing in
    the window): the rejections chart began at the first rejection, beside a requests chart spanning the
    whole history, and its line stopped at the last rejection rate instead of falling back to 0."""
    readings: list[tuple[float, Mapping[str, Any]]] = []
    for h in history:
        t, per = num(first(h, "at", "ts")), h.get(key)
        if t is not None and isinstance(per, Mapping):
            readings.append((t, per))
    tiers = list(dict.fromkeys(str(tier) for _, per in readings for tier, v in per.items() if num(v) is not None))
    rows = [{"time": pd.Timestamp(t, unit="s", tz="UTC"), "tier": tier, "value": num(per.get(tier)) or 0.0}
            for t, per in readings for tier in tiers]
    return pd.DataFrame(rows, columns=["time", "tier", "value"])


BUILTIN_TIERS = ("free", "plus", "enterprise")


def tier_filter_choices(policy: Mapping[str, Any] | None, chosen: str | None, any_: str = "any") -> list[str]:
    """The Usage page's Tier filter: the tiers of the policy in force (an operator's own too; the built-in
    three when it cannot be read), "unknown" (the ledger's tier for a request refused before its key was
    known), and the one chosen before, kept after its tier left the policy."""
    names = list(mapping(mapping(policy).get("tiers"))) or list(BUILTIN_TIERS)
    return list(dict.fromkeys([any_, *names, "unknown", *([chosen] if chosen else [])]))
