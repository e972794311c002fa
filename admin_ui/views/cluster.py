"""The Cluster and Overview pages' member table: health, load, KV usage and heartbeat age per member.

    frame = members_frame(admin.members()["members"], latest, now=time.time())
    counts = status_counts(members)       # {service: {status: n}}
    stages = stages_frame(members)        # a pipelined shard's stages: host and layers of each
    procs = processes_frame(admin.processes(), now=time.time())   # what `switchboard up` restarted, when, why

Called by admin_ui/screens/cluster.py and overview.py. Pure functions, no Streamlit.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from admin_ui.views.read import items, mapping, ms, num


def members_frame(members: Sequence[Mapping[str, Any]], latest: Mapping[str, Any] | None, *,
                  now: float) -> pd.DataFrame:
    """Every member with its health, load, KV usage and heartbeat age (shard figures from signals)."""
    by_id = {str(s.get("member_id") or s.get("id")): s for s in items(latest or {}, "shards") if isinstance(s, Mapping)}
    rows = []
    for m in members:
        meta = mapping(m.get("meta"))
        # the scrape reader names a shard by its member id; the Prometheus one (`up --prometheus`, the
        # control plane's --prometheus) by its scrape target, host:port, which is the member's address
        sig = mapping(by_id.get(str(m.get("id"))) or by_id.get(_address(m.get("url"))))
        running, waiting = num(sig.get("running")), num(sig.get("waiting"))
        slots = num(sig.get("max_num_seqs")) or num(meta.get("max_num_seqs"))
        load = None if running is None or waiting is None else running + waiting
        util = None if load is None or not slots else min(load / slots, 1.0)
        # fingerprint: what decides the shard's numerics (data_plane/shard/engines/fingerprint.py); one seed
        # gives one text on the shards that share it
        detail = ", ".join(f"{k}={meta[k]}" for k in ("model", "engine", "fingerprint", "backend") if meta.get(k))
        if num(meta.get("pipeline_parallel_size")) and num(meta.get("pipeline_parallel_size")) != 1:
            detail += f", {meta['pipeline_parallel_size']} pipeline stages"
        hb = num(m.get("last_heartbeat"))
        kv_bytes = num(sig.get("prefix_cache_bytes"))
        if kv_bytes is None and m.get("service") == "cache":  # a cache node's KV blocks, from its meta
            kv_bytes = num(meta.get("kv_bytes"))
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


def _address(url: object) -> str:
    """``host:port`` of a member URL, as Prometheus names the target (its ``instance`` label)."""
    return str(url or "").split("://", 1)[-1].rstrip("/")


def idle_caption(shards: pd.DataFrame) -> str | None:
    """What the Overview says in words when no shard of `shards` (a `members_frame`) runs or waits for
    anything (an all-zero bar chart drew an empty plot); None when one does. A shard that is not passing is
    named as such, not counted idle: with one of two frozen it said "All 2 shards idle"."""
    if shards[["running", "waiting"]].fillna(0).to_numpy().any():
        return None
    down = shards[shards["status"] != "passing"]
    if down.empty:
        return f"All {len(shards)} shard{'s' if len(shards) > 1 else ''} idle: nothing running or waiting."
    up = len(shards) - len(down)
    named = ", ".join(f"{m} ({st})" for m, st in zip(down["member"], down["status"], strict=True))
    said = f"{up} passing shard{'s' if up != 1 else ''} idle: nothing running or waiting" if up else "No shard passing"
    return f"{said}; not passing: {named}."


def status_counts(members: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """``{service: {status: n}}``."""
    out: dict[str, dict[str, int]] = {}
    for m in members:
        svc = out.setdefault(str(m.get("service", "?")), {})
        st = str(m.get("status", "unknown"))
        svc[st] = svc.get(st, 0) + 1
    return out


def stages_frame(members: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per pipeline stage of every sharded shard (its `pipeline_stages` registration
    metadata: data_plane/shard/stage_view.py): the shard, its health, the stage, its host, its layers."""
    rows = []
    for m in members:
        value = mapping(m.get("meta")).get("pipeline_stages")
        if m.get("service") != "shard" or not isinstance(value, str):
            continue
        entries = _parse_stages(value)
        for stage, host, layers in entries:
            first, _, end = layers.partition("-")
            rows.append({"member": m.get("id", "?"), "status": str(m.get("status") or "unknown"),
                         "stage": f"{stage + 1} of {len(entries)}", "host": host,
                         "layers": f"{first}..{int(end) - 1}" if first.isdigit() and end.isdigit() else layers,
                         "role": "HTTP, scheduler, embedding, LM head" if stage == 0 else "layers only"})
    return pd.DataFrame(rows, columns=["member", "status", "stage", "host", "layers", "role"])


def _parse_stages(value: str) -> list[tuple[int, str, str]]:
    """(stage, host, "first-end") of each "stage@host:first-end" entry (data_plane/shard/stage_view.py's format)."""
    out = []
    for entry in value.split(","):
        stage, _, rest = entry.partition("@")
        host, _, layers = rest.rpartition(":")
        if stage.isdigit() and host and layers:
            out.append((int(stage), host, layers))
    return out



def processes_frame(table: Mapping[str, Any] | None, *, now: float) -> pd.DataFrame:
    """What `switchboard up` supervises (``GET /admin/v1/processes``): per process its pid, state, how long
    its current run has lasted, its restarts and how and when it last died (empty when not under `up`)."""
    rows = []
    for p in items(table or {}, "processes"):
        if not isinstance(p, Mapping):
            continue
        started, died, code = num(p.get("started_at")), num(p.get("last_exit_at")), p.get("last_exit_code")
        exit_text = ""
        if died is not None and isinstance(code, int):
            how = _signal_name(-code) if code < 0 else f"exit code {code}"
            reason = p.get("last_exit_reason")
            how += f" ({reason})" if isinstance(reason, str) and reason else ""
            exit_text = f"{how}, {max(0.0, now - died):.0f} s ago"
        running = bool(p.get("running"))
        rows.append({"process": p.get("name", "?"), "pid": p.get("pid"), "status": "running" if running else "down",
                     "up_s": max(0.0, now - started) if running and started else None,
                     "restarts": int(num(p.get("restarts")) or 0), "last_exit": exit_text, "log": p.get("log") or ""})
    return pd.DataFrame(rows, columns=["process", "pid", "status", "up_s", "restarts", "last_exit", "log"])


def _signal_name(number: int) -> str:
    """SIGKILL for 9; "signal 40" for a number without a name (a real-time signal: valid, but no Signals member)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
