"""`switchboard bench tiers`: does a tier mix above capacity keep enterprise fast and shed free?

    switchboard bench tiers --url http://127.0.0.1:8000 --keys-file .switchboard/credentials.json
    switchboard bench tiers --url URL --keys-file keys.yaml --duration 60 --rate 20 \\
        --mix free=0.6,plus=0.3,enterprise=0.1 --json /tmp/tiers.json

Two phases in one run, against one gateway:

1. **Unloaded baseline**: ``--baseline`` enterprise requests one at a time; their TTFT p95 is
   the reference.
2. **Capacity probe** (unless ``--rate`` is given): a closed loop of as many enterprise
   workers as the gateway lets in flight (its ``switchboard_admission_capacity`` gauge) for
   ``--probe`` s measures the throughput T the shards really sustain (a CPU batch of 16 is
   far from 16x one request).
3. **Overload**: Poisson arrivals at ``--rate`` (default ``--overload`` x T) req/s for
   ``--duration`` s, each request's tier drawn from ``--mix`` and sent with that tier's key.

Per tier it reports requests, admitted (200), shed: 429 (rate limit), 503 from the admission
queue, 503 from the degradation ladder (its message says "degraded"), how many shed
responses carried ``Retry-After``, other errors, and TTFT p50/p95 of the admitted; then
enterprise loaded/unloaded TTFT p95 against ``--target`` (1.5x), and the highest
``x-switchboard-degraded`` level seen. TTFT is request sent ->
first chunk with content, as in ``bench serve``. Keys come from ``switchboard up``'s
``.switchboard/credentials.json`` (``{"keys": {tier: key}}``) or a gateway keys YAML (the first
key of each tier).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from data_plane.bench.common import PROMPTS, fmt, format_table, percentile, write_json
from data_plane.bench.serve import Endpoint, discover_model
from data_plane.common.hop_auth import cluster_token_from_env, metrics_token_from_env, scrape_headers

DEFAULT_MIX = "free=0.6,plus=0.3,enterprise=0.1"


@dataclass
class Outcome:
    """One request as the client saw it (times in time.perf_counter() seconds)."""

    tier: str
    submitted: float
    status: int = 0
    retry_after: bool = False
    ladder: bool = False
    """A 503 from the degradation ladder rather than the admission queue."""
    degraded: int = 0
    first_token: float | None = None
    finished: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.first_token is not None

    @property
    def ttft_ms(self) -> float:
        assert self.first_token is not None
        return (self.first_token - self.submitted) * 1000


@dataclass
class TierReport:
    tier: str
    requests: int = 0
    admitted: int = 0
    shed_429: int = 0
    shed_503: int = 0
    shed_503_ladder: int = 0
    with_retry_after: int = 0
    errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"tier": self.tier, "requests": self.requests, "admitted": self.admitted,
                "shed_429": self.shed_429,
                "shed_503_queue": self.shed_503, "shed_503_ladder": self.shed_503_ladder,
                "shed_with_retry_after": self.with_retry_after, "errors": self.errors,
                "ttft_p50_ms": percentile(self.ttft_ms, 50), "ttft_p95_ms": percentile(self.ttft_ms, 95)}


def load_keys(path: str) -> dict[str, str]:
    """``{tier: key}`` from credentials.json (``{"keys": {tier: key}}``) or a keys YAML."""
    text = Path(path).read_text()
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    keys = data.get("keys") if isinstance(data, dict) else None
    if isinstance(keys, dict):
        return {str(t): str(k) for t, k in keys.items()}
    if isinstance(keys, list):
        out: dict[str, str] = {}
        for entry in keys:
            if isinstance(entry, dict) and entry.get("key") and entry.get("tier"):
                out.setdefault(str(entry["tier"]), str(entry["key"]))
        return out
    raise ValueError(f"{path}: expected {{'keys': {{tier: key}}}} or a keys YAML with plaintext keys")


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for item in text.split(","):
        name, _, share = item.partition("=")
        if not name.strip() or not share:
            raise ValueError(f"--mix takes TIER=SHARE items, got {item!r}")
        mix[name.strip()] = float(share)
    total = sum(mix.values())
    if total <= 0 or any(v < 0 for v in mix.values()):
        raise ValueError("--mix shares must be >= 0 and not all 0")
    return {k: v / total for k, v in mix.items()}


async def send(client: httpx.AsyncClient, endpoint: Endpoint, key: str, tier: str, prompt: str) -> Outcome:
    out = Outcome(tier, time.perf_counter())
    try:
        async with client.stream("POST", endpoint.chat_url, json=endpoint.body(prompt),
                                 headers={"authorization": f"Bearer {key}"}) as resp:
            out.status = resp.status_code
            out.retry_after = "retry-after" in resp.headers
            out.degraded = int(resp.headers.get("x-switchboard-degraded") or 0)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.ladder = resp.status_code == 503 and "degraded" in text
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"].get("code") or "stream_error")
                    break
                if out.first_token is None and any((c.get("delta") or {}).get("content")
                                                   for c in event.get("choices") or []):
                    out.first_token = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = type(exc).__name__
    out.finished = time.perf_counter()
    return out


def load_scrape_headers(path: str) -> dict[str, str]:
    """What reads the gateway's /metrics (guarded): credentials.json's metrics token (`switchboard up`
    writes it), else this environment's SWITCHBOARD_METRICS_TOKEN / SWITCHBOARD_CLUSTER_TOKEN."""
    try:
        data = json.loads(Path(path).read_text()) if path.endswith(".json") else {}
    except (OSError, ValueError):
        data = {}
    token = data.get("metrics_token") if isinstance(data, dict) else None
    return scrape_headers(cluster_token_from_env(), str(token) if token else metrics_token_from_env())


async def gateway_capacity(client: httpx.AsyncClient, base: str, headers: dict[str, str] | None = None) -> int | None:
    try:
        text = (await client.get(base + "/metrics", headers=headers)).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("switchboard_admission_capacity "):
            value = float(line.rsplit(" ", 1)[1])
            return int(value) if value > 0 else None
    return None


async def probe(client: httpx.AsyncClient, endpoint: Endpoint, key: str, workers: int,
                seconds: float) -> float:
    """Completed requests per second of a closed loop of `workers` for `seconds`."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            prompt = f"{PROMPTS[(w + i) % len(PROMPTS)]} (probe {w}.{i})"
            o = await send(client, endpoint, key, "enterprise", prompt)
            done += o.ok
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return done / (time.perf_counter() - t0)


def summarize_tiers(outcomes: list[Outcome], tiers: list[str]) -> list[TierReport]:
    reports = {t: TierReport(t) for t in tiers}
    for o in outcomes:
        r = reports[o.tier]
        r.requests += 1
        if o.ok:
            r.admitted += 1
            r.ttft_ms.append(o.ttft_ms)
        elif o.status in (429, 503):
            r.shed_429 += o.status == 429
            r.shed_503 += o.status == 503 and not o.ladder
            r.shed_503_ladder += o.status == 503 and o.ladder
            r.with_retry_after += o.retry_after
        else:
            r.errors += 1
    return list(reports.values())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    keys = load_keys(args.keys_file)
    mix = parse_mix(args.mix)
    missing = [t for t in mix if t not in keys]
    if missing:
        raise SystemExit(f"switchboard bench tiers: no key for tier(s) {', '.join(missing)} "
                         f"in {args.keys_file}")
    if "enterprise" not in keys:
        raise SystemExit("switchboard bench tiers: the baseline needs an 'enterprise' key")
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits) as client:
        endpoint = Endpoint(args.url, keys["enterprise"], args.model or "", args.max_tokens)
        if not endpoint.model:
            endpoint.model = await discover_model(client, endpoint)
        rng = random.Random(args.seed)

        print(f"[bench tiers] unloaded baseline: {args.baseline} enterprise requests, one at a time",
              flush=True)
        baseline = [await send(client, endpoint, keys["enterprise"], "enterprise",
                               f"{PROMPTS[i % len(PROMPTS)]} (baseline {i})") for i in range(args.baseline)]
        base_ok = [o for o in baseline if o.ok]
        if not base_ok:
            raise SystemExit(f"switchboard bench tiers: the baseline failed: {[o.status for o in baseline]}")
        base_ttft = [o.ttft_ms for o in base_ok]
        e2e_s = sum((o.finished or o.submitted) - o.submitted for o in base_ok) / len(base_ok)
        capacity = await gateway_capacity(client, endpoint.base, load_scrape_headers(args.keys_file))
        print(f"[bench tiers] baseline TTFT p50 {percentile(base_ttft, 50):.0f} ms, p95 "
              f"{percentile(base_ttft, 95):.0f} ms, e2e {e2e_s:.2f} s; "
              f"gateway capacity {capacity or 'unknown'}",
              flush=True)
        rate, throughput = args.rate, None
        if rate is None:
            throughput = await probe(client, endpoint, keys["enterprise"], capacity or 16, args.probe)
            rate = args.overload * throughput
            print(f"[bench tiers] probe: {throughput:.2f} req/s at {capacity or 16} in flight", flush=True)
        print(f"[bench tiers] overload: {rate:.2f} req/s for {args.duration:g} s, mix {args.mix}", flush=True)

        tiers, weights = list(mix), list(mix.values())
        tasks: list[asyncio.Task[Outcome]] = []
        t0 = time.perf_counter()
        i = 0
        while time.perf_counter() - t0 < args.duration:
            tier = rng.choices(tiers, weights)[0]
            prompt = f"{PROMPTS[i % len(PROMPTS)]} (request {i})"
            tasks.append(asyncio.create_task(send(client, endpoint, keys[tier], tier, prompt)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        print(f"[bench tiers] sent {len(tasks)} requests; waiting for the last ones", flush=True)
        outcomes = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0

    reports = summarize_tiers(outcomes, tiers)
    rows = [r.row() for r in reports]
    unloaded_p95 = percentile(base_ttft, 95)
    ent = next((r for r in rows if r["tier"] == "enterprise"), None)
    loaded_p95 = ent["ttft_p95_ms"] if ent else math.nan
    ratio = loaded_p95 / unloaded_p95 if unloaded_p95 else math.nan
    print(format_table(
        ["tier", "requests", "admitted", "429", "503 queue", "503 ladder", "shed w/ Retry-After", "errors",
         "TTFT p50 ms", "TTFT p95 ms"],
        [[r["tier"], str(r["requests"]), str(r["admitted"]), str(r["shed_429"]), str(r["shed_503_queue"]),
          str(r["shed_503_ladder"]),
          str(r["shed_with_retry_after"]), str(r["errors"]), fmt(r["ttft_p50_ms"], 0),
          fmt(r["ttft_p95_ms"], 0)]
         for r in rows]))
    verdict = "meets" if ratio <= args.target else "misses"
    level = max((o.degraded for o in outcomes), default=0)
    print(f"enterprise TTFT p95: loaded {fmt(loaded_p95, 0)} ms / unloaded {fmt(unloaded_p95, 0)} ms = "
          f"{fmt(ratio, 2)}x ({verdict} the {args.target:g}x target); "
          f"highest degradation level seen: {level}")
    return {"tiers": rows, "baseline": {"requests": len(baseline), "ttft_p50_ms": percentile(base_ttft, 50),
                                         "ttft_p95_ms": unloaded_p95, "e2e_s": e2e_s},
            "enterprise_ttft_p95_ratio": ratio, "target": args.target, "meets_target": ratio <= args.target,
            "max_degradation_level": level, "probe_throughput_rps": throughput,
            "config": {"url": args.url, "model": endpoint.model, "rate": rate, "duration_s": args.duration,
                       "wall_s": wall, "mix": mix, "max_tokens": args.max_tokens, "capacity": capacity,
                       "seed": args.seed}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchboard bench tiers",
                                description="A tier mix above capacity: who is served, who is shed, "
                                            "enterprise TTFT.")
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--keys-file", default=".switchboard/credentials.json",
                   help="credentials.json from `switchboard up`, or a keys YAML (default %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default 60)")
    p.add_argument("--rate", type=float, default=None,
                   help="arrivals per second (default: --overload x capacity / unloaded request time)")
    p.add_argument("--overload", type=float, default=2.0,
                   help="how far above capacity the default rate is (2.0)")
    p.add_argument("--probe", type=float, default=10.0,
                   help="seconds of capacity probe before the overload (10)")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"tier shares (default {DEFAULT_MIX})")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--baseline", type=int, default=8, help="unloaded enterprise requests (default 8)")
    p.add_argument("--target", type=float, default=1.5,
                   help="enterprise loaded/unloaded TTFT p95 target (1.5)")
    p.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    p.add_argument("--seed", type=int, default=0, help="seed for arrivals and the tier draw")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.max_tokens < 1 or args.baseline < 1 or (
            args.rate is not None and args.rate <= 0):
        p.error("--duration, --rate, --max-tokens and --baseline must be positive")
    try:
        parse_mix(args.mix)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    if args.json:
        write_json(args.json, result)
