"""`switchboard bench overhead`'s report: per-round batches aggregated into rows, the targets judged
by the rounds' quartiles, and the table printed. Pure functions of the measurements, so tests feed
them made-up rounds (tests/data_plane/test_bench_overhead.py); the run itself is
:mod:`data_plane.bench.overhead`, whose docstring defines every figure.

    rows = aggregate(batches)                       # one row per (system, concurrency)
    checks = check_targets(rows, [1, 16], paced=True)
    print(render(rows, checks))
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from data_plane.bench.common import fmt, format_table, percentile

DIRECT, SWITCHBOARD, LITELLM = "direct", "switchboard", "litellm"


@dataclass
class Batch:
    """One system at one concurrency in one round."""

    system: str
    concurrency: int
    round: int
    latencies_ms: list[float]
    ttfts_ms: list[float]
    errors: dict[str, int] = field(default_factory=dict)
    content_chunks: float = 0.0
    proxy_cpu_ms_per_req: float | None = None
    shard_cpu_ms_per_req: float | None = None

    def stats(self) -> dict[str, float]:
        return {"p50": percentile(self.latencies_ms, 50), "p99": percentile(self.latencies_ms, 99),
                "ttft_p50": percentile(self.ttfts_ms, 50), "ttft_p99": percentile(self.ttfts_ms, 99)}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def aggregate(batches: list[Batch]) -> list[dict[str, Any]]:
    """One row per (system, concurrency): medians across rounds of per-round percentiles and of
    per-round differences against `direct` in the same round (see the module docstring)."""
    by_key: dict[tuple[str, int], dict[int, Batch]] = {}
    for b in batches:
        by_key.setdefault((b.system, b.concurrency), {})[b.round] = b
    rows = []
    for (system, c), rounds in by_key.items():
        direct = by_key.get((DIRECT, c), {})
        stats = {r: b.stats() for r, b in rounds.items() if b.latencies_ms}
        errors = sum(sum(b.errors.values()) for b in rounds.values())
        row: dict[str, Any] = {"system": system, "concurrency": c, "rounds": len(rounds), "errors": errors,
                               "requests": errors + sum(len(b.latencies_ms) for b in rounds.values())}
        for metric in ("p50", "p99", "ttft_p50", "ttft_p99"):
            row[f"{metric}_ms"] = _median([s[metric] for s in stats.values()])
            diffs = [s[metric] - direct[r].stats()[metric] for r, s in stats.items()
                     if r in direct and direct[r].latencies_ms]
            row[f"added_{metric}_ms"] = _median(diffs)
            row[f"added_{metric}_iqr_ms"] = [percentile(diffs, 25), percentile(diffs, 75)]
        cpu = [b.proxy_cpu_ms_per_req for b in rounds.values() if b.proxy_cpu_ms_per_req is not None]
        shard_cpu = [b.shard_cpu_ms_per_req for b in rounds.values() if b.shard_cpu_ms_per_req is not None]
        row["proxy_cpu_ms_per_req"] = _median(cpu) if cpu else None
        row["shard_cpu_ms_per_req"] = _median(shard_cpu) if shard_cpu else None
        row["content_chunks"] = _median([b.content_chunks for b in rounds.values()])
        rows.append(row)
    order = {DIRECT: 0, SWITCHBOARD: 1, LITELLM: 2}
    return sorted(rows, key=lambda r: (r["concurrency"], order.get(r["system"], 9), r["system"]))


TARGETS_MS: tuple[tuple[str, int, str, float], ...] = (
    ("c=1 added p50 <= 1.5 ms", 1, "added_p50_ms", 1.5),
    ("c=1 added p99 <= 5 ms", 1, "added_p99_ms", 5.0),
    ("c=16 added p99 <= 25 ms", 16, "added_p99_ms", 25.0),
)
"""(name, concurrency, row field, limit) for switchboard's row."""
TTFT_TARGETS_MS: tuple[tuple[str, int, str, float], ...] = (
    ("c=1 added TTFT p50 <= 5 ms", 1, "added_ttft_p50_ms", 5.0),
    ("c=1 added TTFT p99 <= 15 ms", 1, "added_ttft_p99_ms", 15.0),
)
"""First content chunk, safety filter on. Only a paced engine (``--token-interval-ms`` > 0) can
show a hold-back: with instant tokens the whole reply arrives in one burst, so these are
"not measured" then."""
LITELLM_RATIO = 1 / 3
"""Switchboard's added p99 must stay within this fraction of LiteLLM's, at each concurrency."""


def check_targets(rows: list[dict[str, Any]], concurrencies: list[int],
                  paced: bool = False) -> list[dict[str, Any]]:
    """Each target with its value (median over rounds), limit and verdict.

    `pass` when even the upper quartile of the per-round values meets the limit, `fail` when even
    the lower quartile misses it, `inconclusive` when the rounds straddle it (a noisy machine:
    rerun), `not measured` without the row; `ok` is True / False / None accordingly."""
    table = {(r["system"], r["concurrency"]): r for r in rows}

    def get(system: str, c: int, key: str) -> float | None:
        value = table.get((system, c), {}).get(key)
        return None if value is None or math.isnan(value) else value

    specs: list[tuple[str, int, str, float | None]] = list(TARGETS_MS)
    specs += [(name, c, key, limit if paced else None) for name, c, key, limit in TTFT_TARGETS_MS]
    for c in concurrencies:
        theirs = get(LITELLM, c, "added_p99_ms")
        specs.append((f"c={c} added p99 <= 1/3 of litellm's", c, "added_p99_ms",
                      None if theirs is None else theirs * LITELLM_RATIO))
    checks = []
    for name, c, key, limit in specs:
        value = get(SWITCHBOARD, c, key)
        lo, hi = table.get((SWITCHBOARD, c), {}).get(key.replace("_ms", "_iqr_ms")) or (value, value)
        if value is None or limit is None or lo is None or hi is None:
            verdict, ok = "not measured", None
        elif hi <= limit:
            verdict, ok = "pass", True
        elif lo > limit:
            verdict, ok = "fail", False
        else:
            verdict, ok = "inconclusive", None
        checks.append({"target": name, "value_ms": value, "iqr_ms": [lo, hi], "limit_ms": limit,
                       "verdict": verdict, "ok": ok})
    return checks


def render(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    headers = ["system", "concurrency", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
               "ttft p50 ms", "added ttft p50", "added ttft p99", "chunks", "proxy cpu ms/req", "errors"]
    body = []
    for r in rows:
        base = r["system"] == DIRECT
        added = [("-" if base else fmt(r[k], 2)) for k in ("added_p50_ms", "added_p99_ms")]
        added_ttft = [("-" if base else fmt(r[k], 2)) for k in ("added_ttft_p50_ms", "added_ttft_p99_ms")]
        body.append([r["system"], str(r["concurrency"]), fmt(r["p50_ms"], 2), fmt(r["p99_ms"], 2), *added,
                     fmt(r["ttft_p50_ms"], 2), *added_ttft, fmt(r["content_chunks"], 1),
                     fmt(r["proxy_cpu_ms_per_req"], 2), str(r["errors"])])
    lines = [format_table(headers, body), "", "targets (switchboard):"]
    for c in checks:
        lo, hi = c["iqr_ms"]
        lines.append(f"  {c['verdict'].upper():<12}  {c['target']:<36} {fmt(c['value_ms'], 2)} ms "
                     f"(rounds' IQR {fmt(lo, 2)}..{fmt(hi, 2)}), limit {fmt(c['limit_ms'], 2)} ms")
    return "\n".join(lines)
