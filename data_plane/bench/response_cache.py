"""`switchboard bench response-cache`: a replayed workload with repeats, the response cache on vs off, one run.

    flock /tmp/sb-bench.lock switchboard bench response-cache --requests 300 --repeat-share 0.3 \\
        --concurrency 4 --json /tmp/response-cache.json

One shard (`--engine synthetic` by default, with `--token-delay-ms` per token; `--engine torch` for the
real model), one cache node and two gateways in front of them: one with `--response-cache`, one
without. The workload is `--requests` non-streamed chat requests at temperature 0, of which about
`--repeat-share` repeat an earlier prompt of the same workload (chosen uniformly among those sent
before); each phase (off, then on) replays the same sequence with its own prompt texts, so the
shard's prefix cache carries nothing from one phase to the other. Reported, per phase: latency
p50/p90 (request sent -> whole body, through the gateway), and for the cache-on phase the hits
(`usage.prompt_tokens_details.cached_tokens == prompt_tokens`, cross-checked with the gateway's
`switchboard_response_cache_lookups_total`) with their own p50/p90 (target p50 <= 5 ms) and the
misses', and the hits' mean lookup time inside the gateway by where they were answered (this
gateway's own copies or the cache nodes, `switchboard_response_cache_lookup_seconds`); then the
shard work each phase cost (requests finished, generated and prompt tokens, from the shard's
vLLM-named metrics) and the share the cache saved next to the hit share (target: equal).
A repeat sent while its first copy is still in flight is a miss (the gateway keeps a reply in its
own memory once complete; the cache nodes' copy is written off the request path): that is part of
what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.common import finish, fmt, format_table, machine_info, percentile
from data_plane.bench.multiturn_turns import user_message
from data_plane.bench.overhead import Proc, switchboard_cmd
from data_plane.common.hop_auth import cluster_token_from_env, metrics_token_from_env, scrape_headers
from data_plane.common.http_server import free_port

BENCH_KEY = "sk-bench-response-cache-0123456789"
HIT_P50_TARGET_MS = 5.0
SHARD_WORK = {"requests": "vllm:request_success_total", "generation_tokens": "vllm:generation_tokens_total",
              "prompt_tokens": "vllm:prompt_tokens_total"}


def _scrape_headers() -> dict[str, str]:
    """The processes started here inherit this environment's tokens: /metrics takes them."""
    return scrape_headers(cluster_token_from_env(), metrics_token_from_env())


def workload(n: int, repeat_share: float, seed: int = 7) -> list[int]:
    """`n` prompt numbers; about `repeat_share` of them repeat one sent before."""
    rng = random.Random(seed)
    out: list[int] = []
    fresh = 0
    for _ in range(n):
        if out and rng.random() < repeat_share:
            out.append(rng.choice(out))
        else:
            out.append(fresh)
            fresh += 1
    return out


def scrape(url: str, names: dict[str, str]) -> dict[str, float]:
    got = dict.fromkeys(names, 0.0)
    wanted = {v: k for k, v in names.items()}
    for line in httpx.get(url + "/metrics", timeout=10, headers=_scrape_headers()).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            got[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return got


def lookups(gateway_url: str) -> dict[str, float]:
    """The gateway's lookup outcomes by result, and the hits' lookup time (sum, count) by source
    as `hit_seconds_sum:<source>` / `hit_seconds_count:<source>`."""
    out: dict[str, float] = {}
    for line in httpx.get(gateway_url + "/metrics", timeout=10, headers=_scrape_headers()).text.splitlines():
        if line.startswith("switchboard_response_cache_lookups_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = out.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
        for part in ("sum", "count"):
            if line.startswith(f"switchboard_response_cache_lookup_seconds_{part}{{") and 'result="hit"' in line:
                name = f"hit_seconds_{part}:" + line.split('source="', 1)[1].split('"', 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def hit_lookup_ms(looked: dict[str, float]) -> dict[str, Any]:
    """Per source, the hits and their mean lookup time inside the gateway (ms)."""
    out: dict[str, Any] = {}
    for source in ("local", "nodes"):
        n = looked.get(f"hit_seconds_count:{source}", 0.0)
        out[source] = {"hits": n, "mean_ms": looked.get(f"hit_seconds_sum:{source}", 0.0) * 1000 / n if n else None}
    return out


async def replay(http: httpx.AsyncClient, url: str, phase: str, seq: list[int], args: argparse.Namespace,
                 model: str) -> list[dict[str, Any]]:
    """Send `seq` in order, `args.concurrency` at a time; one row per request."""
    rows: list[dict[str, Any]] = []
    queue = list(enumerate(seq))
    queue.reverse()

    async def worker() -> None:
        while queue:
            i, k = queue.pop()
            body = {"model": model, "temperature": 0, "max_tokens": args.max_tokens,
                    "messages": [{"role": "user", "content": f"[{phase}] " + user_message(k, 0, args.user_tokens)}]}
            sent = time.perf_counter()
            r = await http.post(url + "/v1/chat/completions", json=body,
                                headers={"authorization": f"Bearer {BENCH_KEY}"})
            ms = (time.perf_counter() - sent) * 1000
            row: dict[str, Any] = {"i": i, "prompt": k, "ms": ms, "status": r.status_code}
            if r.status_code == 200:
                usage = r.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                row["hit"] = cached == usage["prompt_tokens"] > 0
            rows.append(row)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return sorted(rows, key=lambda r: r["i"])


def latency(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [r["ms"] for r in rows]
    return {"n": len(ms), "p50_ms": percentile(ms, 50) if ms else None, "p90_ms": percentile(ms, 90) if ms else None}


def report(seq: list[int], phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The summary: latencies, hit share, shard work saved."""
    on, off = phases["on"], phases["off"]
    ok_on = [r for r in on["rows"] if r["status"] == 200]
    hits = [r for r in ok_on if r.get("hit")]
    out: dict[str, Any] = {
        "requests": len(seq), "repeats": len(seq) - len(set(seq)),
        "errors": {p: sum(1 for r in v["rows"] if r["status"] != 200) for p, v in phases.items()},
        "off": latency([r for r in off["rows"] if r["status"] == 200]),
        "on_all": latency(ok_on), "on_hits": latency(hits),
        "on_misses": latency([r for r in ok_on if not r.get("hit")]),
        "hit_share": len(hits) / len(seq), "gateway_hits": on["lookups"].get("hit", 0.0),
        "gateway_hit_lookup": hit_lookup_ms(on["lookups"]),
        "hit_p50_target_ms": HIT_P50_TARGET_MS,
    }
    out["hit_p50_within_target"] = (out["on_hits"]["p50_ms"] is not None
                                    and out["on_hits"]["p50_ms"] <= HIT_P50_TARGET_MS)
    out["shard_work"] = {p: v["shard"] for p, v in phases.items()}
    out["shard_work_saved"] = {k: 1 - on["shard"][k] / off["shard"][k] if off["shard"][k] else None
                               for k in SHARD_WORK}
    return out


async def measure(args: argparse.Namespace, shard: Proc, gateways: dict[str, Proc], model: str) -> dict[str, Any]:
    seq = workload(args.requests, args.repeat_share, args.seed)
    phases: dict[str, dict[str, Any]] = {}
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        for phase, gw in gateways.items():  # warm-up: lazy imports, first kernels, connections
            for _ in range(2):
                await replay(http, gw.url, f"warm-{phase}", [0], args, model)
        for phase, gw in gateways.items():
            before, looked = scrape(shard.url, SHARD_WORK), lookups(gw.url)
            load0, t0 = os.getloadavg()[0], time.perf_counter()
            rows = await replay(http, gw.url, phase, seq, args, model)
            after = scrape(shard.url, SHARD_WORK)
            phases[phase] = {"rows": rows, "wall_s": time.perf_counter() - t0,
                             "shard": {k: after[k] - before[k] for k in SHARD_WORK},
                             "lookups": {k: v - looked.get(k, 0.0) for k, v in lookups(gw.url).items()},
                             "loadavg": [load0, os.getloadavg()[0]]}
            print(f"{phase}: {len(rows)} requests in {phases[phase]['wall_s']:.1f} s "
                  f"(load {load0:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)
    return {"workload": seq, "phases": phases, "summary": report(seq, phases)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchboard bench response-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--repeat-share", type=float, default=0.3, help="share of requests repeating an earlier prompt")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--engine", default="synthetic", choices=("synthetic", "torch"))
    p.add_argument("--token-delay-ms", type=float, default=10.0, help="synthetic engine: per generated token")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="torch engine")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--user-tokens", type=int, default=60, help="prompt size (~tokens)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--json", help="write the rows and the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="sb-response-cache-"))
    sp, cp = free_port(), free_port()
    engine = (["--engine", "synthetic", "--synthetic-token-delay-ms", str(args.token_delay_ms)]
              if args.engine == "synthetic" else ["--engine", "torch", "--dtype", args.dtype])
    shard = Proc("shard", switchboard_cmd("shard", "--port", str(sp), *engine), sp, "/health", logs)
    cache = Proc("cache", switchboard_cmd("cache-node", "--port", str(cp)), cp, "/health", logs)
    model = "synthetic" if args.engine == "synthetic" else "SmolLM2-135M-Instruct"
    gateways: dict[str, Proc] = {}
    for phase in ("off", "on"):
        gp = free_port()
        flags = ["--tokenizer", "whitespace", "--model-name", "synthetic"] if args.engine == "synthetic" else []
        gateways[phase] = Proc(f"gateway-{phase}", switchboard_cmd(
            "gateway", "--port", str(gp), "--shard-urls", shard.url, "--cache-urls", cache.url, "--usage-db", "off",
            "--state-dir", str(logs / f"state-{phase}"), *flags, *(["--response-cache"] if phase == "on" else [])),
            gp, "/health", logs, env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})
    procs = [shard, cache, *gateways.values()]
    machine = machine_info()
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_healthy(args.startup_timeout)
        result = asyncio.run(measure(args, shard, gateways, model))
    finally:
        for proc in reversed(procs):
            proc.stop()
    result["machine"] = {**machine, "loadavg_end": list(os.getloadavg())}
    result["args"] = vars(args)
    s = result["summary"]
    print(format_table(["rows", "n", "p50 ms", "p90 ms"],
                       [[name, str(s[name]["n"]), fmt(s[name]["p50_ms"], 1), fmt(s[name]["p90_ms"], 1)]
                        for name in ("off", "on_all", "on_hits", "on_misses")]))
    finish(result, logs, args.json, {k: s[k] for k in ("requests", "repeats", "hit_share", "gateway_hits",
                                                        "gateway_hit_lookup", "hit_p50_within_target", "shard_work",
                                                        "shard_work_saved", "errors")})


if __name__ == "__main__":
    main()
