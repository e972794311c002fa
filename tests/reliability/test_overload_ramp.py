"""Overload with the real model: short and long conversations at 0.5x, 1x and 2x the measured
capacity of two torch shards (slow; ~5 min; bounded; loopback only).

    flock /tmp/sb-bench.lock .venv/bin/python -m pytest tests/reliability/test_overload_ramp.py -m slow -s

The synthetic engine hides prefill (its TTFT does not depend on the prompt), which is how a ladder
driven by raw TTFT shipped (docs/RELIABILITY.md G4). Here every figure comes from SmolLM2-135M in the
torch engine: a control plane with ``--autoscale`` (local actuator, 2..3 shards of 4 slots, 1 thread
each, at most one per core: ``--local-max-shards``; prefix caching off so a long conversation
prefills all of it), one cache node, one gateway.
Rate limits are lifted (a tiers file) so what is measured is overload, not RPM.

1. unloaded: UNLOADED_N enterprise requests of the same mix (LONG_SHARE of them long, shuffled), one at a
   time, at level 0 before anything has loaded the fleet: their TTFT p95 is the baseline. (It was 16
   requests, 4 long, measured after the capacity loop: its p95 was the slowest long prompt, 0.40-0.70 s
   between runs, and the ladder raised by the capacity loop could still be shrinking contexts. With 40 the
   p95 is an interior order statistic of the long prompts, as it is in the 2x phase's ~100 enterprise
   requests: the same mix, the same quantile; one slow sample no longer sets it. The bound is unchanged.)
2. capacity: a closed loop of 8 clients (the two shards' slots) of the mix for CAPACITY_S (was 25 s); C is
   the completed requests per second *weighted by kind*: each completion counts its kind's unloaded mean
   request time over the mix's mean, so a window that happened to draw more short (or long) conversations
   than LONG_SHARE does not read high (or low). The raw rate is printed beside it;
3. open-loop Poisson arrivals at 0.5 C, 1 C and 2 C for PHASE_S each, tiers free 50 % / plus 30 % /
   enterprise 20 %, conversations 75 % short (one question) / 25 % long (~550 prompt tokens);
4. then no load: the ladder must come back to 0 by itself within RECOVER_S.

Per phase the JSON line also splits where time went, from the processes' own metrics: enterprise
admission wait at the gateway (``switchboard_admission_wait_seconds{tier="enterprise"}`` mean), the shards'
engine queue and prefill means (``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds``,
every tier), prompts prefilled beside a chunked one (``switchboard_shard_prefill_beside_chunk_total``) and
priority preemptions; and enterprise TTFT p95 per conversation kind against the unloaded one (shown, not
asserted: the bound is on the mix).

Pass: at 0.5x the level stays 0 and nothing is shed; at 2x free is shed (and more than plus, and
enterprise never), enterprise TTFT p95 stays within ENTERPRISE_RATIO of its unloaded value, the
autoscaler scales out (a ``scale_up`` decision that is not the min-replicas bound: carried out, or
"capped" on a host with fewer cores than shards asked); level 0 after.
The figures are printed as one JSON line (``overload_ramp``) for docs/RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from data_plane.common.cores import usable_cores
from tests.support.cluster import ADMIN_TOKEN, LIFTED_TIERS
from tests.support.metrics import metric_in, scrape
from tests.support.procs import Service

pytestmark = pytest.mark.slow

HOST_SHARDS = max(2, usable_cores())
"""One-thread shards this host holds, counted from the cores this process may use (affinity and cgroup quota,
not the host's count): past them a third shard slows all three (on 2 cores it made enterprise TTFT p95
3.1x unloaded at 2x); the scale-out is then recorded with the outcome "capped"."""

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CAPACITY_S = 40.0
UNLOADED_N = 40
PHASE_S = 40.0
RECOVER_S = 150.0
FACTORS = (0.5, 1.0, 2.0)
ENTERPRISE_RATIO = 1.5
MAX_TOKENS = 12
TIER_MIX = (("free", 0.5), ("plus", 0.3), ("enterprise", 0.2))
LONG_SHARE = 0.25
KEYS = {"free": "sk-ramp-free-0123456789", "plus": "sk-ramp-plus-0123456789",
        "enterprise": "sk-ramp-ent-0123456789"}
LONG_CONTEXT = ("The harbour town kept its lighthouse lit through every storm of the long winter, and the keeper "
                "wrote each night in a ledger what ships passed and what the weather did. ") * 16


@dataclass
class Outcome:
    phase: str
    tier: str
    kind: str
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    levels: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    timeline: list[str] = field(default_factory=list)
    """One ``phase:level/serving shards`` per second of load."""


def _messages(kind: str, i: int) -> list[dict[str, str]]:
    question = {"role": "user", "content": f"Question {i}: name one colour of the sea, in one word."}
    if kind == "short":
        return [question]
    return [{"role": "user", "content": LONG_CONTEXT}, {"role": "assistant", "content": "Noted."}, question]


async def _one(http: httpx.AsyncClient, tier: str, kind: str, i: int, phase: str) -> Outcome:
    sent = time.perf_counter()
    body = {"messages": _messages(kind, i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEYS[tier]}"}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Outcome(phase, tier, kind, resp.status_code)
            ttft = None
            async for line in resp.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"content":' in line:
                    ttft = time.perf_counter() - sent
            return Outcome(phase, tier, kind, 200, ttft, time.perf_counter() - sent)
    except httpx.HTTPError:
        return Outcome(phase, tier, kind, 0)


def _pick(rng: random.Random) -> tuple[str, str]:
    r, acc, tier = rng.random(), 0.0, "free"
    for name, share in TIER_MIX:
        acc += share
        if r < acc:
            tier = name
            break
    return tier, ("long" if rng.random() < LONG_SHARE else "short")


async def _closed_loop(url: str, clients: int, seconds: float) -> tuple[float, dict[str, int]]:
    """Completed requests per second with `clients` always waiting on an answer, and how many of each kind."""
    rng = random.Random(1)
    done = {"short": 0, "long": 0}
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def client(c: int) -> None:
            i = 0
            while time.monotonic() < end:
                _, kind = _pick(rng)  # the mix of conversations; one tier, so nothing is shed
                if (await _one(http, "enterprise", kind, c * 1000 + i, "capacity")).status == 200:
                    done[kind] += 1
                i += 1

        start = time.monotonic()
        await asyncio.gather(*(client(c) for c in range(clients)))
        return sum(done.values()) / (time.monotonic() - start), done


def _weighted(rate: float, done: dict[str, int], cost: dict[str, float]) -> float:
    """`rate` as if the completions had the mix's share of long conversations: each counts its kind's
    `cost` (unloaded mean request time) over the mix's mean cost."""
    n = sum(done.values())
    mix = LONG_SHARE * cost["long"] + (1 - LONG_SHARE) * cost["short"]
    return rate * sum(done[k] * cost[k] for k in done) / n / mix if n else rate


def _shard_urls(cp: Service) -> list[str]:
    members = httpx.get(cp.url + "/v1/registry/members", timeout=10).json()["members"]
    return [m["url"] for m in members if m["service"] == "shard" and m["status"] == "passing"]


Histograms = dict[str, tuple[str, dict[str, str]]]
_COUNTERS: Histograms = {"admission_wait_s": ("switchboard_admission_wait_seconds", {"tier": "enterprise"})}
_SHARD_COUNTERS: Histograms = {"queue_s": ("vllm:request_queue_time_seconds", {}),
                               "prefill_s": ("vllm:request_prefill_time_seconds", {})}


def _readings(gateway: Service, cp: Service) -> dict[str, float]:
    """Cumulative sums/counts of the gateway's and the shards' own timings, for per-phase deltas."""
    out: dict[str, float] = {}
    text = scrape(gateway.url)
    for key, (name, labels) in _COUNTERS.items():
        out[key + "_sum"] = metric_in(text, name + "_sum", **labels)
        out[key + "_n"] = metric_in(text, name + "_count", **labels)
    for url in _shard_urls(cp):
        try:
            text = scrape(url)
        except httpx.HTTPError:
            continue
        for key, (name, labels) in _SHARD_COUNTERS.items():
            out[key + "_sum"] = out.get(key + "_sum", 0.0) + metric_in(text, name + "_sum", **labels)
            out[key + "_n"] = out.get(key + "_n", 0.0) + metric_in(text, name + "_count", **labels)
        out["beside"] = out.get("beside", 0.0) + metric_in(text, "switchboard_shard_prefill_beside_chunk_total")
        for kind in ("prefill", "decode"):
            out["preempt_" + kind] = out.get("preempt_" + kind, 0.0) + metric_in(
                text, "switchboard_shard_priority_preemptions_total", kind=kind)
    return out


def _split(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Per-phase means (seconds) and counts from two :func:`_readings`."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out: dict[str, float | None] = {}
    for key in list(_COUNTERS) + list(_SHARD_COUNTERS):
        n = d.get(key + "_n", 0.0)
        out[key + "_mean"] = d.get(key + "_sum", 0.0) / n if n > 0 else None
    out.update(beside_prompts=d.get("beside", 0.0), preempt_prefill=d.get("preempt_prefill", 0.0),
               preempt_decode=d.get("preempt_decode", 0.0))
    return out


async def _open_loop(url: str, cp_url: str, rate: float, seconds: float, phase: str, run: Run, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=200)) as http, \
            httpx.AsyncClient(timeout=5, headers=ADMIN) as admin:
        tasks: list[asyncio.Task[Outcome]] = []
        end = time.monotonic() + seconds
        next_sample = 0.0
        i = 0
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                next_sample = now + 1.0
                try:
                    level = (await admin.get(cp_url + "/admin/v1/degradation")).json()["level"]
                    members = (await admin.get(cp_url + "/v1/registry/members")).json()["members"]
                except httpx.HTTPError:
                    continue
                run.levels[phase].add(level)
                shards = sum(m["service"] == "shard" and m["status"] == "passing" for m in members)
                run.timeline.append(f"{phase}:{level}/{shards}")
            tier, kind = _pick(rng)
            if sum(not t.done() for t in tasks) < 200:
                tasks.append(asyncio.create_task(_one(http, tier, kind, i, phase)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        run.outcomes += await asyncio.gather(*tasks)


def _p95(values: list[float]) -> float | None:
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) >= 2 else None


def _serving(cp: Service) -> int:
    members = httpx.get(cp.url + "/v1/registry/members", timeout=10).json()["members"]
    return sum(m["service"] == "shard" and m["status"] == "passing" for m in members)


def _get(cp: Service, path: str) -> Any:
    return httpx.get(cp.url + path, headers=ADMIN, timeout=10).json()


def test_short_and_long_conversations_at_half_one_and_twice_capacity(tmp_path: Path) -> None:
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(LIFTED_TIERS)
    shard_args = ["--engine", "torch", "--max-num-seqs", "4", "--threads", "1", "--max-model-len", "2048",
                  "--prefix-caching", "off"]
    cp = Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0", "--tiers-file", str(tiers),
                  "--degradation-interval", "1", "--degradation-raise-dwell", "5", "--signals-window", "20",
                  "--degradation-lower-dwell", "20", "--degradation-lower-dwell-gauge", "5",
                  "--autoscale", "--min-replicas", "2", "--max-replicas", "3", "--autoscale-interval-s", "2",
                  "--scale-up-cooldown-s", "5", "--scale-down-cooldown-s", "30", "--shard-log-dir", str(tmp_path),
                  "--local-max-shards", str(HOST_SHARDS),
                  "--shard-args", shlex.join(shard_args)])
    cache = Service(["cache-node", "--registry-url", cp.url, "--node-id", "cache-0"])
    keys = ",".join(f"{key}:{tier}-co:{tier}" for tier, key in KEYS.items())
    gateway = Service(["gateway", "--registry-url", cp.url, "--max-model-len", "2048", "--tiers-file", str(tiers)],
                      env={"SWITCHBOARD_GATEWAY_API_KEYS": keys}, ready_timeout=120)
    cp.start()
    run = Run()
    figures: dict[str, Any] = {}
    try:
        cache.start()
        gateway.start()
        deadline = time.monotonic() + 240
        while httpx.get(gateway.url + "/health", timeout=2).json().get("shards", 0) < 2:
            assert time.monotonic() < deadline, "the autoscaler's two torch shards did not serve"
            time.sleep(0.5)
        asyncio.run(_closed_loop(gateway.url, 2, 5.0))  # warm both shards
        figures["loadavg_start"] = os.getloadavg()
        kinds = ["long"] * round(UNLOADED_N * LONG_SHARE)
        kinds += ["short"] * (UNLOADED_N - len(kinds))
        random.Random(3).shuffle(kinds)
        level_before = _get(cp, "/admin/v1/degradation")["level"]
        unloaded = [asyncio.run(_single(gateway.url, "enterprise", kind, j)) for j, kind in enumerate(kinds)]
        assert level_before == 0 and _get(cp, "/admin/v1/degradation")["level"] == 0, "unloaded, not at level 0"
        base = _p95([o.ttft_s for o in unloaded if o.ttft_s is not None])
        cost = {k: statistics.mean(o.e2e_s for o in unloaded if o.kind == k and o.e2e_s is not None)
                for k in ("short", "long")}
        base_kind = {k: _p95([o.ttft_s for o in unloaded if o.kind == k and o.ttft_s is not None])
                     for k in ("short", "long")}
        raw, done = asyncio.run(_closed_loop(gateway.url, 8, CAPACITY_S))
        capacity = _weighted(raw, done, cost)
        figures.update(capacity_rps=round(capacity, 2), capacity_raw_rps=round(raw, 2), capacity_done=done,
                       unloaded_request_s=cost, enterprise_unloaded_ttft_p95_s=base,
                       enterprise_unloaded_ttft_p95_by_kind_s=base_kind)
        # the capacity loop ran the fleet at 1x: the ladder may have risen and the autoscaler scaled
        # out; start the ramp from level 0 on the two shards C was measured for
        settle_deadline = time.monotonic() + RECOVER_S
        while _get(cp, "/admin/v1/degradation")["level"] != 0 or _serving(cp) != 2:
            assert time.monotonic() < settle_deadline, "level 0 on two shards not reached before the ramp"
            time.sleep(1.0)
        figures["settled_s"] = round(RECOVER_S - (settle_deadline - time.monotonic()), 1)
        t_load, load_wall = time.monotonic(), time.time()
        splits: dict[str, dict[str, float | None]] = {}
        for n, factor in enumerate(FACTORS):
            before = _readings(gateway, cp)
            asyncio.run(_open_loop(gateway.url, cp.url, factor * capacity, PHASE_S, f"{factor:g}x", run, seed=n))
            splits[f"{factor:g}x"] = _split(before, _readings(gateway, cp))
        t_end = time.monotonic()
        figures["loadavg_end"] = os.getloadavg()
        recovered_s = None
        while time.monotonic() - t_end < RECOVER_S:
            if _get(cp, "/admin/v1/degradation")["level"] == 0:
                recovered_s = round(time.monotonic() - t_end, 1)
                break
            time.sleep(1.0)
        decisions = _get(cp, "/admin/v1/decisions")["decisions"]
        history = _get(cp, "/admin/v1/degradation")["history"]
        figures.update(load_s=round(t_end - t_load, 1), recovered_to_level_0_s=recovered_s,
                       scale_ups=[(d["from"], d["to"], d["code"], d["outcome"][:40]) for d in decisions  # the ramp
                                  if d["action"] == "scale_up" and d["code"] != "bounds"
                                  and d["last_at"] >= load_wall],
                       ladder=[(e["from"], e["to"], e["reason"][:80]) for e in history])
    finally:
        for svc in (gateway, cache, cp):
            svc.stop()

    by_phase: dict[str, dict[str, Any]] = {}
    for factor in FACTORS:
        phase = f"{factor:g}x"
        rows = [o for o in run.outcomes if o.phase == phase]
        entry: dict[str, Any] = {"offered": len(rows), "levels": sorted(run.levels[phase])}
        for tier, _ in TIER_MIX:
            mine = [o for o in rows if o.tier == tier]
            ttfts = [o.ttft_s for o in mine if o.ttft_s is not None]
            entry[tier] = {"n": len(mine), "ok": sum(o.status == 200 for o in mine),
                           "shed": sum(o.status in (429, 503) for o in mine),
                           "other": sum(o.status not in (200, 429, 503) for o in mine),
                           "ttft_p95_s": _p95(ttfts), "ttft_p50_s": statistics.median(ttfts) if ttfts else None}
        ent = [o for o in rows if o.tier == "enterprise" and o.ttft_s is not None]
        entry["enterprise_ttft_p95_by_kind_s"] = {k: _p95([o.ttft_s for o in ent if o.kind == k and o.ttft_s])
                                                  for k in ("short", "long")}
        entry["where_time_went"] = splits.get(phase)
        by_phase[phase] = entry
    figures["phases"] = by_phase
    figures["timeline"] = " ".join(run.timeline)
    print("\noverload_ramp " + json.dumps(figures, default=lambda v: round(v, 3) if isinstance(v, float) else v))

    half, double = by_phase["0.5x"], by_phase["2x"]
    assert half["levels"] == [0], half
    assert all(half[t]["shed"] == 0 and half[t]["other"] == 0 for t, _ in TIER_MIX), half
    assert double["free"]["shed"] > 0, double
    assert double["free"]["shed"] / double["free"]["n"] >= double["plus"]["shed"] / max(1, double["plus"]["n"])
    assert double["enterprise"]["shed"] == 0 and double["enterprise"]["other"] == 0, double
    assert figures["scale_ups"], "the autoscaler did not scale out at 2x"
    assert figures["recovered_to_level_0_s"] is not None, "the ladder did not come back to 0"
    assert base is not None and double["enterprise"]["ttft_p95_s"] is not None
    ratio = double["enterprise"]["ttft_p95_s"] / base
    # Met with a small margin (docs/RELIABILITY.md §8): with same-priority prompts beside a chunked
    # prefill in one mixed pass, 1.46x and 1.40x on clean baselines (1.48-1.51x without the mixed pass);
    # the tail is long enterprise prompts behind long ones on one shard (routing counts requests).
    assert ratio <= ENTERPRISE_RATIO, f"enterprise TTFT p95 {ratio:.2f}x its unloaded value (bound {ENTERPRISE_RATIO}x)"


async def _single(url: str, tier: str, kind: str, i: int) -> Outcome:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await _one(http, tier, kind, i, "unloaded")
