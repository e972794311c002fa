"""`switchboard bench multiturn`: conversations that grow, with prefix caching off vs on, in one run.

    flock /tmp/sb-bench.lock switchboard bench multiturn --conversations 8 --turns 8 \\
        --json /tmp/multiturn.json --png docs/img/multiturn-ttft.png

For each system (`--systems off,on`: `--prefix-caching off` / `on`) it starts a real stack on
loopback — one torch shard on the real model, one cache node, one gateway (static URLs) — and
drives `--conversations` concurrent sessions (`X-Session-Id`) of `--turns` turns each: every user
turn adds about `--user-tokens` new tokens and the reply up to `--max-tokens`, so the history
grows to ~1.5-1.8k tokens with the defaults. Each turn is streamed; TTFT is request sent -> first
content chunk, as in `bench serve`. Per system and turn it reports TTFT p50/p90, prompt tokens
(`history_tokens`: the whole prompt the shard saw), prefill tokens computed (prompt minus
`usage.prompt_tokens_details.cached_tokens`), the hit rate, and the ideal hit rate under
affinity (every full 16-token block the previous turn's slot held). Then throughput at a 0 % hit
rate (one-shot prompts that each start with a unique system line), in interleaved rounds
(off, on, on, off, ...) so machine drift lands on both alike: aggregate output tokens/s, on/off.

`--systems failover,failover-off` adds rows (c) and (c'): the session's shard killed mid-conversation,
the next turn on another shard with its KV from the cache nodes, or recomputed
(data_plane/bench/multiturn_failover.py; `--failover-turn`).

`--api responses` compares the Responses API (`previous_response_id`) with sessions instead, on one
stack in the same run: TTFT per history length and their ratio (data_plane/bench/multiturn_responses.py).

`--systems affinity,kv_aware` compares the gateway's routing policies instead, across a scale-out
mid-conversation (data_plane/bench/multiturn_routing.py).

JSON rows carry `system`, `turn`, `history_tokens`, `ttft_p50_ms`, ...; `--png` plots TTFT p50
against history length per system (matplotlib, the `test`/`sim` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.common import finish, fmt, format_table, machine_info
from data_plane.bench.multiturn_failover import FAILOVER_SYSTEMS, LABELS, run_failover
from data_plane.bench.multiturn_turns import (
    BENCH_KEY,
    BLOCK,
    SYSTEM_PROMPT,
    Turn,
    conversation,
    stream_turn,
    turn_rows,
    user_message,
    warm_up,
)
from data_plane.bench.overhead import Proc, switchboard_cmd
from data_plane.common.hop_auth import cluster_token_from_env, metrics_token_from_env, scrape_headers
from data_plane.common.http_server import free_port

__all__ = ["BENCH_KEY", "BLOCK", "SYSTEM_PROMPT", "Turn", "conversation", "main", "stream_turn", "turn_rows",
           "user_message"]  # the client side lives in multiturn_turns.py; re-exported for older importers

async def throughput(http: httpx.AsyncClient, url: str, args: argparse.Namespace, round_no: int) -> dict[str, Any]:
    """Closed loop of --conversations workers over one-shot prompts that share no prefix."""
    headers = {"authorization": f"Bearer {BENCH_KEY}"}
    queue = list(range(args.throughput_requests))
    done: list[Turn] = []

    async def worker() -> None:
        while queue:
            n = queue.pop()
            body = {"messages": [{"role": "system", "content": f"Request {round_no}-{n}-{os.urandom(4).hex()}. "
                                  + SYSTEM_PROMPT},
                                 {"role": "user", "content": user_message(10_000 + n, round_no, args.user_tokens)}],
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t = Turn(-1, n)
            await stream_turn(http, url, body, headers, t)
            done.append(t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.conversations)))
    wall = time.perf_counter() - t0
    ok = [t for t in done if t.error is None]
    return {"requests": len(ok), "errors": len(done) - len(ok), "wall_s": wall,
            "output_tok_s": sum(t.completion_tokens for t in ok) / wall,
            "cached_tokens": sum(t.cached_tokens for t in ok), "prompt_tokens": sum(t.prompt_tokens for t in ok)}


def _scrape_headers() -> dict[str, str]:
    """The processes started here inherit this environment's tokens: /metrics takes them."""
    return scrape_headers(cluster_token_from_env(), metrics_token_from_env())


def shard_sums(url: str) -> dict[str, float]:
    """The shard's TTFT and prefill-time histogram sums and counts (its own view, without the
    gateway's hops and output hold-back)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10, headers=_scrape_headers()).text.splitlines():
        for name in ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds"):
            for part in ("_sum", "_count"):
                if line.startswith(name + part + "{"):
                    out[name + part] = out.get(name + part, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def engine_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    view = {}
    for name, key in (("vllm:time_to_first_token_seconds", "engine_ttft_mean_ms"),
                      ("vllm:request_prefill_time_seconds", "engine_prefill_mean_ms")):
        n = d.get(name + "_count", 0.0)
        view[key] = 1000 * d.get(name + "_sum", 0.0) / n if n else float("nan")
    return view


class Stack:
    """One shard (prefix caching on or off), one cache node and one gateway, on loopback."""

    def __init__(self, system: str, args: argparse.Namespace, logs: Path) -> None:
        sp, cp, gp = free_port(), free_port(), free_port()
        self.shard = Proc(f"shard-{system}", switchboard_cmd(
            "shard", "--port", str(sp), "--prefix-caching", system, "--dtype", args.dtype,
            "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads)), sp, "/health", logs)
        self.cache = Proc(f"cache-{system}", switchboard_cmd("cache-node", "--port", str(cp)), cp, "/health", logs)
        self.gateway = Proc(f"gateway-{system}", switchboard_cmd(
            "gateway", "--port", str(gp), "--shard-urls", self.shard.url, "--cache-urls", self.cache.url,
            "--usage-db", "off", "--state-dir", str(logs / f"state-{system}"),
            "--first-token-timeout-s", "300"), gp, "/health", logs,
            env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})
        self.procs = [self.shard, self.cache, self.gateway]

    def start(self, timeout: float) -> None:
        for p in self.procs:
            p.start()
        for p in self.procs:
            p.wait_healthy(timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


async def measure(args: argparse.Namespace, stacks: dict[str, Stack]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    raw: dict[str, list[dict[str, Any]]] = {}
    engine: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=600) as http:
        for system, stack in stacks.items():  # warm-up: lazy imports, first kernels
            await warm_up(http, stack.gateway.url, system)
        for system, stack in stacks.items():
            t0 = time.perf_counter()
            load0 = os.getloadavg()[0]
            sums = shard_sums(stack.shard.url)
            convs = await asyncio.gather(*(conversation(http, stack.gateway.url, c, args)
                                           for c in range(args.conversations)))
            turns = [t for conv in convs for t in conv]
            raw[system] = [t.__dict__ for t in turns]
            rows += turn_rows(system, turns)
            engine[system] = engine_view(sums, shard_sums(stack.shard.url))
            print(f"{system}: {len(turns)} turns in {time.perf_counter() - t0:.0f} s "
                  f"(load {load0:.2f} -> {os.getloadavg()[0]:.2f}), errors: "
                  f"{sum(1 for t in turns if t.error)}", flush=True)
        order = list(stacks)
        rounds = [order if r % 2 == 0 else order[::-1] for r in range(args.throughput_rounds)]
        tput: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
        for r, systems in enumerate(rounds):
            for system in systems:
                tput[system].append(await throughput(http, stacks[system].gateway.url, args, r))
    return {"rows": rows, "throughput": tput, "turns": raw, "engine": engine}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    out: dict[str, Any] = {}
    by = {(r["system"], r["turn"]): r for r in rows}
    last = max((r["turn"] for r in rows), default=0)
    if ("off", last) in by and ("on", last) in by:
        out["last_turn"] = last
        out["last_turn_history_tokens"] = by[("on", last)]["history_tokens"]
        out["last_turn_ttft_speedup"] = by[("off", last)]["ttft_p50_ms"] / by[("on", last)]["ttft_p50_ms"]
    on = [r for r in rows if r["system"] == "on" and r["turn"] > 0]
    if on:
        hit = sum(r["hit_rate"] * r["history_tokens"] for r in on)
        ideal = sum(r["ideal_hit_rate"] * r["history_tokens"] for r in on)
        out["follow_up_hit_rate"] = hit / sum(r["history_tokens"] for r in on)
        out["hit_rate_vs_ideal"] = hit / ideal if ideal else None
    eng = result.get("engine", {})
    if "on" in eng and "off" in eng:
        out["engine_ttft_mean_ms"] = {s: v["engine_ttft_mean_ms"] for s, v in eng.items()}
        out["engine_ttft_mean_speedup"] = eng["off"]["engine_ttft_mean_ms"] / eng["on"]["engine_ttft_mean_ms"]
    tput = result["throughput"]
    if tput.get("on") and tput.get("off"):
        med = {s: sorted(x["output_tok_s"] for x in v)[len(v) // 2] for s, v in tput.items() if v}
        out["zero_hit_output_tok_s"] = med
        out["zero_hit_on_over_off"] = med["on"] / med["off"]
        out["zero_hit_cached_tokens_on"] = sum(x["cached_tokens"] for x in tput["on"])
    return out


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    labels = {"off": "(a) prefix caching off", "on": "(b) prefix caching on", **LABELS}
    for system in dict.fromkeys(r["system"] for r in rows):
        # In turn order: a degraded gateway's shorter window (bench rows (c')) must not fold the line back.
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["turn"])
        ax.plot([r["history_tokens"] for r in mine], [r["ttft_p50_ms"] / 1000 for r in mine], marker="o",
                label=labels.get(system, system))
    ax.set_xlabel("prompt tokens (history + new turn)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchboard bench multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--api", default="chat", choices=("chat", "responses"),
                   help="responses: the Responses API next to sessions, same run (prefix caching on)")
    p.add_argument("--systems", default="off,on", help="prefix caching settings to compare (off,on)")
    p.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--turns", type=int, default=8, help="turns per conversation (default 8)")
    p.add_argument("--user-tokens", type=int, default=150, help="new tokens per user turn (~)")
    p.add_argument("--max-tokens", type=int, default=48, help="reply cap per turn")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads per shard (0 = all cores)")
    p.add_argument("--throughput-requests", type=int, default=16, help="one-shot requests per throughput round")
    p.add_argument("--throughput-rounds", type=int, default=2, help="interleaved rounds (off,on / on,off ...)")
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--failover-turn", type=int, default=None,
                   help="failover systems: the session's shard is killed before this turn (default turns - 2)")
    p.add_argument("--join-after", type=int, default=3,
                   help="routing systems (affinity,kv_aware): a second shard joins after this turn")
    p.add_argument("--shard-args", default="",
                   help="routing systems: extra shard flags, e.g. '--kv-tier off' (a moved session recomputes)")
    p.add_argument("--json", help="write rows, throughput and summary here")
    p.add_argument("--png", help="plot TTFT p50 against history length here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.api == "responses":  # imported by name, as multiturn_routing: it builds on this module
        return importlib.import_module("data_plane.bench.multiturn_responses").run(args)
    if systems and set(systems) <= {"affinity", "kv_aware"}:  # KV-aware routing vs session hashing
        # Imported by name: multiturn_routing builds on this module (no import cycle).
        return importlib.import_module("data_plane.bench.multiturn_routing").run(args, systems)
    if not set(systems) <= {"on", "off", *FAILOVER_SYSTEMS}:
        raise SystemExit("--systems takes on, off, failover and/or failover-off, or routing policies affinity "
                         "and/or kv_aware")
    logs = Path(tempfile.mkdtemp(prefix="sb-multiturn-"))
    stacks = {s: Stack(s, args, logs) for s in systems if s in ("on", "off")}
    machine = machine_info()
    result: dict[str, Any] = {"rows": [], "throughput": {}, "turns": {}, "engine": {}}
    try:
        for s in stacks.values():
            s.start(args.startup_timeout)
        if stacks:
            result = asyncio.run(measure(args, stacks))
    finally:
        for s in stacks.values():
            s.stop()
    result["summary"] = summary(result)
    failover = [s for s in systems if s in FAILOVER_SYSTEMS]
    if failover:  # rows (c) / (c'): data_plane/bench/multiturn_failover.py
        got = run_failover(args, failover, logs)
        result["rows"] += got["rows"]
        result["turns"].update(got["turns"])
        result["failover"] = got["failover"]
        result["summary"].update(got.get("summary", {}))
    result["machine"] = {**machine, "loadavg_end": list(os.getloadavg())}
    result["args"] = vars(args)
    headers = ["system", "turn", "history_tokens", "ttft_p50_ms", "ttft_p90_ms", "prefill_computed", "hit_rate",
               "ideal_hit"]
    print(format_table(headers, [[r["system"], str(r["turn"]), str(r["history_tokens"]), fmt(r["ttft_p50_ms"], 0),
                                  fmt(r["ttft_p90_ms"], 0), str(r["prefill_tokens_computed"]),
                                  f"{r['hit_rate']:.1%}", f"{r['ideal_hit_rate']:.1%}"] for r in result["rows"]]))
    for system, rounds in result["throughput"].items():
        print(f"throughput at 0 % hit rate, {system}: " + ", ".join(
            f"{x['output_tok_s']:.1f} tok/s ({x['requests']} req, cached {x['cached_tokens']})" for x in rounds))
    finish(result, logs, args.json)
    if args.png:
        plot(result["rows"], args.png, f"{args.conversations} conversations x {args.turns} turns, "
             f"{machine.get('cpu_model')}, {args.dtype}")


if __name__ == "__main__":
    main()
