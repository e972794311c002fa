"""`switchboard bench ttft`: where a follow-up turn's time to first token goes, reuse off vs on.

    flock /tmp/sb-bench.lock switchboard bench ttft --conversations 4 --turns 9 --json /tmp/ttft.json

Runs bench multiturn's workload (data_plane/bench/multiturn.py: its stack and conversations, same
flags) on one stack per system, one after the other (`--systems off,on`), then reads every request's
spans back from the gateway and the shard (``/debug/spans``) and splits the TTFT of the turns with at
least ``--min-prompt`` prompt tokens into: the gateway before routing (auth, session load, context
window), the hop to the shard, the shard's queue (waiting for other requests' steps), copy-in +
prefill (the ``queue`` / ``prefill`` events on ``shard.generate``), prefill done -> first token at
the gateway (emit, SSE, the hop back), and the gateway's output hold-back. Prints p50 / mean per
part and the per-turn TTFT table with the (a)/(b) ratio at the last turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.common import format_table, machine_info, write_json
from data_plane.bench.multiturn import (
    BENCH_KEY,
    Stack,
    Turn,
    conversation,
    parse_args,
    stream_turn,
    turn_rows,
)
from data_plane.common.hop_auth import cluster_headers, cluster_token_from_env

PARTS = ("gateway TTFT", "gateway before routing", "hop to the shard", "shard queue", "shard copy-in + prefill",
         "prefill done -> first token at the gateway", "gateway hold-back")


def run_system(system: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    stack = Stack(system, args, logs)
    try:
        stack.start(args.startup_timeout)

        async def drive() -> list[list[Turn]]:
            async with httpx.AsyncClient(timeout=600) as http:
                await stream_turn(http, stack.gateway.url, {"messages": [{"role": "user", "content": "Hello"}],
                                                            "max_tokens": 4, "stream": True},
                                  {"authorization": f"Bearer {BENCH_KEY}"}, Turn(-1, -1))
                return list(await asyncio.gather(*(conversation(http, stack.gateway.url, c, args)
                                                   for c in range(args.conversations))))

        load0 = os.getloadavg()[0]
        convs = asyncio.run(drive())
        spans = recent_spans(stack.gateway.url) + recent_spans(stack.shard.url)
    finally:
        stack.stop()
    turns = [t for conv in convs for t in conv]
    return {"rows": turn_rows(system, turns), "spans": spans, "load": [load0, os.getloadavg()[0]]}


def recent_spans(url: str) -> list[dict[str, Any]]:
    """A process's ``/debug/spans``, with the cluster token the processes started here inherited (without
    it, a shell that exported SWITCHBOARD_CLUSTER_TOKEN got a 401 body, and the bench a TypeError)."""
    r = httpx.get(url + "/debug/spans", timeout=30, headers=cluster_headers(cluster_token_from_env()))
    r.raise_for_status()
    spans: list[dict[str, Any]] = r.json()
    return spans


def breakdown(spans: list[dict[str, Any]], min_prompt: int) -> list[dict[str, float]]:
    """One dict of PARTS (ms) per request with at least `min_prompt` prompt tokens."""
    traces: dict[str, dict[str, dict[str, Any]]] = {}
    for sp in spans:
        traces.setdefault(sp["trace_id"], {})[sp["name"]] = sp
    out = []
    for named in traces.values():
        g, r, sh = named.get("gateway.request"), named.get("router.route"), named.get("shard.generate")
        if not (g and r and sh):
            continue
        events = {e["name"]: e["attributes"] for e in sh["events"]}
        if "prefill" not in events or sh["attributes"].get("gen_ai.usage.input_tokens", 0) < min_prompt:
            continue
        queue, prefill = events["queue"]["duration_s"], events["prefill"]["duration_s"]
        done_ns = sh["start_ns"] + 1e9 * (queue + prefill)
        # router.route lasts as long as the stream; its first_token event is when the gateway had the token
        first_ns = next((e["time_ns"] for e in r["events"] if e["name"] == "first_token"), r["end_ns"])
        out.append(dict(zip(PARTS, (
            1000 * g["attributes"].get("switchboard.gateway.ttft_s", 0.0), (r["start_ns"] - g["start_ns"]) / 1e6,
            (sh["start_ns"] - r["start_ns"]) / 1e6, 1000 * queue, 1000 * prefill, (first_ns - done_ns) / 1e6,
            1000 * g["attributes"].get("switchboard.gateway.holdback_s", 0.0)))))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    min_prompt = 1400
    if "--min-prompt" in argv:
        i = argv.index("--min-prompt")
        min_prompt = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not set(systems) <= {"off", "on"}:
        raise SystemExit("--systems takes off and/or on")
    logs = Path(tempfile.mkdtemp(prefix="sb-ttft-"))
    result: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "min_prompt": min_prompt, "systems": {}}
    for system in systems:
        got = run_system(system, args, logs)
        parts = breakdown(got["spans"], min_prompt)
        got["breakdown"] = {p: {"p50_ms": statistics.median(x[p] for x in parts),
                                "mean_ms": statistics.mean(x[p] for x in parts)} for p in PARTS} if parts else {}
        got["requests"] = len(parts)
        result["systems"][system] = got
        print(f"{system}: {len(parts)} requests with >= {min_prompt} prompt tokens; load "
              f"{got['load'][0]:.2f} -> {got['load'][1]:.2f}", flush=True)
    print(format_table(["part (ms)", *(f"{s} p50 / mean" for s in systems)],
                       [[p, *(f"{result['systems'][s]['breakdown'][p]['p50_ms']:.1f} / "
                              f"{result['systems'][s]['breakdown'][p]['mean_ms']:.1f}"
                              if result["systems"][s]["breakdown"] else "-" for s in systems)] for p in PARTS]))
    rows = [r for s in systems for r in result["systems"][s]["rows"]]
    print(format_table(["system", "turn", "history_tokens", "ttft_p50_ms", "prefill_computed", "hit_rate"],
                       [[r["system"], str(r["turn"]), str(r["history_tokens"]), f"{r['ttft_p50_ms']:.0f}",
                         str(r["prefill_tokens_computed"]), f"{r['hit_rate']:.1%}"] for r in rows]))
    by = {(r["system"], r["turn"]): r for r in rows}
    last = max((r["turn"] for r in rows), default=0)
    if ("off", last) in by and ("on", last) in by:
        result["last_turn_ratio"] = by[("off", last)]["ttft_p50_ms"] / by[("on", last)]["ttft_p50_ms"]
        print(f"turn {last} ({by[('on', last)]['history_tokens']} tokens): (a)/(b) TTFT p50 "
              f"{result['last_turn_ratio']:.2f}x")
    if args.json:
        for got in result["systems"].values():
            got.pop("spans", None)
        write_json(args.json, result)


if __name__ == "__main__":
    main()
