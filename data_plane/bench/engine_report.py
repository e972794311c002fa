"""`switchboard bench engine`'s report: rounds pooled into rows, the ratios between systems, decode
speed against the memory-bandwidth ceiling, and the tables printed. Functions of the measurements only
(rows as data_plane/bench/engine.py's `make_row` builds them), so tests feed them made-up rows
(tests/data_plane/test_bench_spec.py); the run itself, and what each figure means, is
:mod:`data_plane.bench.engine`.

    rows = pool_rounds(round_rows)                   # one row per (system, concurrency)
    ratio = ratios(rows)                             # {"switchboard/naive": {"<concurrency>": ratio}, ...}
    bw = bandwidth_report(rows, weights, gb_s)       # batch-1 tok/s against bandwidth / weight bytes
    print_report(rows, ratio, bw)
    print_weights(rows, weights, dense, resident)
"""

from __future__ import annotations

import math
from typing import Any

from data_plane.bench.common import fmt, format_table
from data_plane.bench.engine_baseline import SUFFIX as BASE

_SUMMED = ("requests", "failed", "output_tokens", "duration_s", "spec_drafts", "spec_draft_tokens",
           "spec_accepted_tokens")


def pool_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, concurrency) from every round's rows: throughput over all rounds' tokens
    and time, latency figures the mean of the rounds', each round's tok/s kept (`round_tok_s`)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    pooled = []
    for group in groups.values():
        if len(group) == 1:
            pooled.append(group[0])
            continue
        row = dict(group[0])
        row.pop("round", None)
        row["rounds"] = len(group)
        for key, value in group[0].items():
            values = [g[key] for g in group if g.get(key) is not None]
            if key in _SUMMED:
                row[key] = sum(values)
            elif isinstance(value, float) and key != "output_tok_s" and len(values) == len(group):
                row[key] = sum(values) / len(values)
        row["peak_rss_mb"] = max((g.get("peak_rss_mb") or 0) for g in group)
        row["round_tok_s"] = [g["output_tok_s"] for g in group]
        row["output_tok_s"] = row["output_tokens"] / row["duration_s"] if row["duration_s"] > 0 else math.nan
        row["mean_output_tokens"] = row["output_tokens"] / row["requests"] if row["requests"] else 0.0
        drafts = row.get("spec_drafts")
        if drafts:
            row["acceptance_rate"] = row["spec_accepted_tokens"] / row["spec_draft_tokens"]
            row["mean_accepted_length"] = 1 + row["spec_accepted_tokens"] / drafts
            width = max(len(g.get("accepted_per_pos") or []) for g in group)
            row["accepted_per_pos"] = [
                sum(g["spec_drafts"] * (g["accepted_per_pos"][p] if p < len(g["accepted_per_pos"]) else 0.0)
                    for g in group if g.get("spec_drafts")) / drafts
                for p in range(width)
            ]
        pooled.append(row)
    return pooled


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """switchboard/<other> output tok/s at each concurrency both systems ran."""
    by = {(r["system"], r["concurrency"]): r["output_tok_s"] for r in rows}
    out: dict[str, dict[str, float]] = {}
    piped = sorted({(s, "switchboard") for s, _ in by if s.startswith("switchboard@pp")})
    for ours, other in (*piped, ("switchboard", "naive"), ("switchboard", "llamacpp"), ("switchboard-spec", "switchboard"),
                        ("switchboard-spec", "naive"), ("switchboard-spec", "llamacpp"),
                        ("switchboard-spec", "llamacpp-lookup"), ("llamacpp-lookup", "llamacpp"),
                        ("switchboard", "switchboard" + BASE), ("switchboard-spec", "switchboard-spec" + BASE),
                        ("switchboard" + BASE, "naive"), ("switchboard" + BASE, "llamacpp")):
        pairs = {
            str(c): by[(ours, c)] / by[(other, c)]
            for (s, c) in by
            if s == other and (ours, c) in by and by[(other, c)] > 0
        }
        if pairs:
            out[f"{ours}/{other}"] = pairs
    return out


def bandwidth_report(rows: list[dict[str, Any]], weights: dict[str, int], gb_s: float) -> dict[str, Any]:
    """Batch-1 decode tok/s (1 / mean TPOT at concurrency 1) against bandwidth / weight bytes."""
    systems = {}
    for r in rows:
        if r["concurrency"] != 1 or not weights.get(r["system"]) or not r["tpot_mean_ms"] > 0:
            continue
        ceiling = gb_s * 1e9 / weights[r["system"]]
        achieved = 1000.0 / r["tpot_mean_ms"]
        systems[r["system"]] = {
            "weight_bytes": weights[r["system"]],
            "ceiling_tok_s": ceiling,
            "decode_tok_s": achieved,
            "pct_of_ceiling": 100.0 * achieved / ceiling,
        }
    return {"copy_gb_s": gb_s, "method": "torch copy_ of a 256 MiB tensor, best of 5, read+write bytes",
            "systems": systems}


def print_report(rows: list[dict[str, Any]], ratio: dict[str, dict[str, float]], bw: dict[str, Any]) -> None:
    print()
    print(format_table(
        ["system", "dtype", "conc", "reqs", "tok/req", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
         "TPOT p50 ms", "TPOT p99 ms", "peak RSS MiB"],
        [[r["system"], r["dtype"], str(r["concurrency"]), str(r["requests"]), fmt(r["mean_output_tokens"]),
          fmt(r["output_tok_s"]), fmt(r["ttft_p50_ms"]), fmt(r["ttft_p99_ms"]), fmt(r["tpot_p50_ms"], 2),
          fmt(r["tpot_p99_ms"], 2), fmt(r.get("peak_rss_mb"), 0)] for r in rows],
    ))
    pooled = [r for r in rows if r.get("round_tok_s")]
    if pooled:
        print(f"\n{pooled[0]['rounds']} rounds pooled (orders alternate); out tok/s of each round:")
        for r in pooled:
            print(f"  {r['system']:<24} c={r['concurrency']:<3} " + "  ".join(fmt(x) for x in r["round_tok_s"]))
    if ratio:
        levels = sorted({int(c) for pairs in ratio.values() for c in pairs})
        print("\noutput tok/s ratios (llama.cpp runs its GGUF quantisation, not the torch dtype)")
        print(format_table(["ratio", *(f"c={c}" for c in levels)],
                           [[name, *(fmt(pairs.get(str(c)), 2) + ("x" if str(c) in pairs else "") for c in levels)]
                            for name, pairs in ratio.items()]))
    spec = [r for r in rows if r.get("spec_drafts")]
    if spec:
        print("\nspeculation (n-gram): acceptance = accepted / draft tokens; mean accepted length = tokens per "
              "drafting step; per position: share of drafts accepted there")
        print(format_table(
            ["system", "conc", "drafts", "acceptance", "mean acc. len", "accepted per position"],
            [[r["system"], str(r["concurrency"]), str(r["spec_drafts"]), fmt(r["acceptance_rate"], 2),
              fmt(r["mean_accepted_length"], 2), " ".join(f"{x:.2f}" for x in r["accepted_per_pos"])]
             for r in spec]))
    print(f"\nbatch-1 decode vs memory bandwidth (copy {bw['copy_gb_s']:.1f} GB/s; ceiling = bandwidth / weight bytes)")
    if not bw["systems"]:
        print("  (needs a concurrency-1 level: add 1 to --concurrency)")
        return
    print(format_table(
        ["system", "weights MiB", "ceiling tok/s", "decode tok/s", "% of ceiling"],
        [[name, fmt(s["weight_bytes"] / 2**20), fmt(s["ceiling_tok_s"]), fmt(s["decode_tok_s"]),
          fmt(s["pct_of_ceiling"])] for name, s in bw["systems"].items()],
    ))


def cpu_summary() -> str:
    """The CPU model, torch's kernel level and the ISA flags the dtype choice reads."""
    from data_plane.shard.engines.weight_source import CpuCaps

    return CpuCaps.detect().summary()


def print_weights(rows: list[dict[str, Any]], weights: dict[str, int], dense: dict[str, int],
                  resident: dict[str, int]) -> None:
    """Weights per system: read by a decode step and resident, against the model's dense bf16 bytes."""
    ref = max(dense.values(), default=0)
    served = {r["system"]: r["dtype"] for r in rows}
    print(f"\nweights (x dense bf16 = {ref / 2**20:.1f} MiB, each weight once; llama.cpp: its GGUF file)" if ref
          else "\nweights")
    print(format_table(["system", "served as", "MiB read/step", "x bf16", "MiB resident"],
                       [[n, served.get(n, "-"), fmt(b / 2**20), fmt(b / ref, 3) if ref else "-",
                         fmt(resident.get(n, b) / 2**20)] for n, b in weights.items()]))
    print(f"CPU: {cpu_summary()}")
