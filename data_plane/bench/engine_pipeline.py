"""`switchboard bench engine --pipeline-parallel-size 1,2`: the pipeline systems' names and the issue's targets.

    parse_pipeline("2mb1bq1")            # PipelineVariant(stages=2, microbatches=1, batch_queue=1)
    pipeline_names([1, 2], [0], [1, 0])  # ["switchboard", "switchboard@pp2bq1", "switchboard@pp2"]
    pipeline_targets(rows)               # per N > 1 system: tok/s at the top concurrency and TPOT at 1, vs N = 1

A system `switchboard@pp<N>[mb<M>][bq<B>]` is the switchboard engine as N stage processes sharing
--threads, with M micro-batches a pass that goes alone (--pipeline-microbatches; 0 / absent: N)
and B plans in flight across steps (--pipeline-batch-queue, the batch queue; 0 / absent: N; 1: off).
The targets (issue 26, same total cores): aggregate tok/s at 16 streams with N = 2 >= 0.85x N = 1,
one stream's TPOT with N = 2 <= 1.15x N = 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TOK_S_TARGET = 0.85
TPOT_TARGET = 1.15
_NAME = re.compile(r"^(\d+)(?:mb(\d+))?(?:bq(\d+))?$")


@dataclass(frozen=True)
class PipelineVariant:
    stages: int = 1
    microbatches: int = 0
    batch_queue: int = 0


def parse_pipeline(suffix: str) -> PipelineVariant:
    """The part of a system name after `@pp` ("" for an unsharded one)."""
    if not suffix:
        return PipelineVariant()
    m = _NAME.match(suffix)
    if m is None:
        raise ValueError(f"pipeline system suffix must be <N>[mb<M>][bq<B>], not {suffix!r}")
    return PipelineVariant(int(m[1]), int(m[2] or 0), int(m[3] or 0))


def pipeline_names(sizes: list[int], microbatches: list[int], batch_queues: list[int]) -> list[str]:
    """The switchboard systems of one run: N = 1 once, each N > 1 once per (M, B) asked for."""
    return [f"switchboard@pp{n}" + (f"mb{mb}" if mb else "") + (f"bq{bq}" if bq else "") if n > 1 else "switchboard"
            for n in sizes for mb in (microbatches if n > 1 else [0]) for bq in (batch_queues if n > 1 else [0])]


def pipeline_targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each `switchboard@pp*` system that ran beside `switchboard`: its output tok/s at the highest
    concurrency both ran, over N = 1's, and its TPOT p50 at concurrency 1 over N = 1's, each against
    the issue's target, and each stage's idle (bubble) share at both."""
    by = {(r["system"], r["concurrency"]): r for r in rows}
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({s for s, _ in by if s.startswith("switchboard@pp")}):
        shared = [c for (s, c) in by if s == name and ("switchboard", c) in by]
        if not shared:
            continue
        entry: dict[str, Any] = {}
        top = max(shared)
        base, mine = by[("switchboard", top)], by[(name, top)]
        if top > 1 and base["output_tok_s"] > 0:
            r = mine["output_tok_s"] / base["output_tok_s"]
            entry.update({"concurrency": top, "tok_s_ratio": round(r, 3), "tok_s_target_met": r >= TOK_S_TARGET,
                          "idle_share_top": mine.get("pipeline_idle_share")})
        if 1 in shared and by[("switchboard", 1)]["tpot_p50_ms"] and by[(name, 1)]["tpot_p50_ms"]:
            r = by[(name, 1)]["tpot_p50_ms"] / by[("switchboard", 1)]["tpot_p50_ms"]
            entry.update({"tpot_ratio": round(r, 3), "tpot_target_met": r <= TPOT_TARGET,
                          "idle_share_1": by[(name, 1)].get("pipeline_idle_share")})
        if entry:
            out[name] = entry
    return out


def print_targets(targets: dict[str, dict[str, Any]]) -> None:
    for name, t in targets.items():
        parts = []
        if "tok_s_ratio" in t:
            parts.append(f"tok/s at c={t['concurrency']} {t['tok_s_ratio']:.2f}x N=1 (target >= {TOK_S_TARGET}: "
                         f"{'met' if t['tok_s_target_met'] else 'NOT met'}; stage idle {t['idle_share_top']})")
        if "tpot_ratio" in t:
            parts.append(f"TPOT at c=1 {t['tpot_ratio']:.2f}x N=1 (target <= {TPOT_TARGET}: "
                         f"{'met' if t['tpot_target_met'] else 'NOT met'}; stage idle {t['idle_share_1']})")
        print(f"[bench] {name} vs switchboard: " + "; ".join(parts), flush=True)
