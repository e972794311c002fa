"""Load ramp: the platform scales out, degrades, sheds free and recovers by itself (slow; ~3 min).

    .venv/bin/python -m pytest tests/control_plane/test_load_ramp.py -m slow -s

Real processes on 127.0.0.1: a control plane with ``--autoscale`` (local actuator, 1..3 synthetic
shards of 4 batch slots, 16 tokens at 60 ms: ~1 s a reply, so ~4 requests/s a shard and ~12/s at
the most), one cache node and one gateway. Nothing is pinned or scaled by hand. An open-loop client
offers a tier mix (60 % free over many keys, each under free's 60 rpm; 30 % plus; 10 % enterprise):

1. ``baseline``: a few enterprise requests one at a time (unloaded TTFT);
2. ``ramp``: arrivals grow linearly to ``RATE_MAX`` (about twice what three shards serve);
3. ``hold``: ``RATE_MAX`` held;
4. ``after``: no load; wait until the ladder is back at 0 and the fleet at one shard;
5. ``recovered``: a few requests per tier, served normally again.

Asserted from the admin API and the responses: a ``scale_up`` decision and more than one shard
serving; the ladder raised automatically (actor ``auto``) to level >= 3; free answered 503 +
Retry-After by the ladder while enterprise kept succeeding; after the load, ``scale_down`` decisions
and level 0 within ``RECOVER_S``. The decision log, the ladder's history and per-phase figures are
printed (docs/LOAD_RAMP.md quotes a run).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from data_plane.bench.common import percentile
from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import Service
from tests.support.waits import eventually

pytestmark = pytest.mark.slow

SLOTS = 4
TOKEN_DELAY_MS = 60
SHARD_ARGS = f"--engine synthetic --synthetic-token-delay-ms {TOKEN_DELAY_MS} --max-num-seqs {SLOTS}"
MAX_REPLICAS = 3
TTFT_SLO_S = 1.0
RATE_START, RATE_MAX = 2.0, 24.0
"""Open-loop arrivals per second at the start of the ramp and while holding (3 shards serve ~12)."""
RAMP_S, HOLD_S = 30.0, 40.0
RECOVER_S = 100.0
"""Bound on the ladder reaching 0 and the fleet one shard once the load stops."""
MIX = {"free": 0.6, "plus": 0.3, "enterprise": 0.1}
MAX_OUTSTANDING = 300
"""Client-side cap on requests in flight: an overloaded server cannot make the client grow."""
ENTERPRISE_MIN_SUCCESS = 0.9
"""Enterprise answers 200 at least this often while the load is on (generous: 2 shared cores)."""

CONTROL_PLANE_FLAGS = [
    "--autoscale", "--min-replicas", "1", "--max-replicas", str(MAX_REPLICAS),
    "--target-waiting-per-shard", "2", "--ttft-slo-s", str(TTFT_SLO_S),
    "--scale-up-cooldown-s", "3", "--scale-down-cooldown-s", "8", "--autoscale-interval-s", "1",
    "--signals-window", "5", "--drain-timeout-s", "10",
    "--degradation-interval", "1", "--degradation-raise-dwell", "3", "--degradation-lower-dwell", "5",
    "--shard-args", SHARD_ARGS,
]  # fmt: skip

KEYS = {
    "free": [f"sk-ramp-free-{i:02d}-0123456789" for i in range(40)],  # ~15 free req/s: ~23 rpm a key
    "plus": [f"sk-ramp-plus-{i}-0123456789" for i in range(4)],
    "enterprise": ["sk-ramp-ent-0-0123456789"],
}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _keys_env() -> str:
    return ",".join(f"{k}:{tier}-co:{tier}" for tier, keys in KEYS.items() for k in keys)


# -- the client ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    phase: str
    tier: str
    status: int
    retry_after: str | None = None
    degraded: int = 0
    """``x-switchboard-degraded`` (0 when absent)."""
    ladder: bool = False
    """A 503 from the degradation ladder (its message says "degraded"), not the admission queue."""
    ttft_s: float | None = None
    """Sent -> first chunk with content, for 200s."""
    code: str | None = None


@dataclass
class Ramp:
    gateway: str
    cp: str
    outcomes: list[Outcome] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.time)
    phase: str = "baseline"
    phase_at: dict[str, float] = field(default_factory=dict)

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.phase_at[phase] = round(time.time() - self.t0, 1)

    async def one(self, http: httpx.AsyncClient, tier: str, key: str, n: int) -> Outcome:
        phase, sent = self.phase, time.perf_counter()
        body = {
            "messages": [{"role": "user", "content": f"{tier} question {n} about the ramp"}],
            "max_tokens": 16,
            "stream": True,
        }
        out = Outcome(phase, tier, 0)
        try:
            async with http.stream(
                "POST",
                self.gateway + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                out.status = r.status_code
                out.retry_after = r.headers.get("retry-after")
                out.degraded = int(r.headers.get("x-switchboard-degraded", "0"))
                if r.status_code != 200:
                    error = json.loads(await r.aread()).get("error", {})
                    out.code = error.get("code")
                    out.ladder = r.status_code == 503 and "degraded" in str(error.get("message"))
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out.code = chunk["error"].get("code") or "stream_error"
                        elif out.ttft_s is None and any(c["delta"].get("content") for c in chunk["choices"]):
                            out.ttft_s = time.perf_counter() - sent
        except (httpx.HTTPError, ValueError) as exc:
            out.code = type(exc).__name__
        self.outcomes.append(out)
        return out

    async def offer(self, http: httpx.AsyncClient, seconds: float, rate_at: Any) -> None:
        """Open loop: Poisson arrivals at `rate_at(elapsed)` per second for `seconds`."""
        rng = random.Random(5)
        tiers, weights = list(MIX), list(MIX.values())
        cycles = {tier: itertools.cycle(keys) for tier, keys in KEYS.items()}
        sem = asyncio.Semaphore(MAX_OUTSTANDING)
        tasks: set[asyncio.Task[Outcome]] = set()
        start = time.monotonic()
        for n in itertools.count():
            elapsed = time.monotonic() - start
            if elapsed >= seconds:
                break
            tier = rng.choices(tiers, weights)[0]
            if sem.locked():  # the client's own cap: count it, never queue without bound
                self.outcomes.append(Outcome(self.phase, tier, -1, code="client_cap"))
            else:
                await sem.acquire()
                task = asyncio.create_task(self.one(http, tier, next(cycles[tier]), n))
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: sem.release())
                tasks.add(task)
            await asyncio.sleep(rng.expovariate(rate_at(elapsed)))
        if tasks:
            await asyncio.gather(*tasks)

    async def watch(self, http: httpx.AsyncClient) -> None:
        """Once a second: the ladder, the fleet and the signals, as the admin API shows them."""
        while True:
            row: dict[str, Any] = {"t": round(time.time() - self.t0, 1), "phase": self.phase}
            try:
                ladder = (await http.get(self.cp + "/admin/v1/degradation", headers=ADMIN)).json()
                signals = (await http.get(self.cp + "/admin/v1/signals", headers=ADMIN)).json()[
                    "latest"
                ] or {}
                members = (
                    await http.get(self.cp + "/v1/registry/members", params={"service": "shard"})
                ).json()
                row.update(
                    level=ladder["level"],
                    verdict=ladder["automatic"]["verdict"],
                    serving=sum(m["status"] == "passing" for m in members["members"]),
                    waiting_per_shard=signals.get("waiting_per_shard"),
                    ttft_p95_s=signals.get("ttft_p95_s"),
                    error_rate=signals.get("error_rate"),
                    demand_rps=round(sum((signals.get("demand_by_tier") or {}).values()), 1),
                    rejected_rps=round(sum((signals.get("rejections_by_tier") or {}).values()), 1),
                    complete=signals.get("complete"),
                    missing=signals.get("missing"),
                )
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            self.timeline.append(row)
            await asyncio.sleep(1.0)

    def recovered(self, decisions: list[dict[str, Any]]) -> bool:
        last = self.timeline[-1] if self.timeline else {}
        downs = [d for d in decisions if d["action"] == "scale_down" and d["outcome"] == "ok"]
        return last.get("level") == 0 and last.get("serving") == 1 and bool(downs) and downs[-1]["to"] == 1


async def _run(ramp: Ramp) -> None:
    limits = httpx.Limits(max_connections=MAX_OUTSTANDING + 10, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
        watcher = asyncio.create_task(ramp.watch(http), name="load-ramp-watch")
        try:
            ramp.enter("baseline")
            for n in range(8):
                await ramp.one(http, "enterprise", KEYS["enterprise"][0], n)
            ramp.enter("ramp")
            await ramp.offer(
                http, RAMP_S, lambda t: RATE_START + (RATE_MAX - RATE_START) * min(1.0, t / RAMP_S)
            )
            ramp.enter("hold")
            await ramp.offer(http, HOLD_S, lambda t: RATE_MAX)
            ramp.enter("after")
            deadline = time.monotonic() + RECOVER_S
            while time.monotonic() < deadline and not ramp.recovered(await _decisions(http, ramp.cp)):
                await asyncio.sleep(1.0)
            ramp.enter("recovered")
            for n, tier in enumerate(["free", "plus", "enterprise"] * 3):
                await ramp.one(http, tier, KEYS[tier][n % len(KEYS[tier])], n)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def _decisions(http: httpx.AsyncClient, cp: str) -> list[dict[str, Any]]:
    r = await http.get(cp + "/admin/v1/decisions", params={"limit": 1000}, headers=ADMIN)
    r.raise_for_status()
    return list(r.json()["decisions"])


# -- the report ----------------------------------------------------------------------------------


def _ms(values: list[float], p: float) -> str:
    return "-" if not values else f"{percentile(values, p) * 1000:.0f}"


def figures(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Per phase and tier: sent, 200, 429, 503 (ladder / queue), Retry-After on shed, other, TTFT."""
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[(o.phase, o.tier)].append(o)
    rows = []
    for (phase, tier), group in groups.items():
        ok = [o for o in group if o.status == 200 and o.code is None]
        shed = [o for o in group if o.status in (429, 503)]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        rows.append({
            "phase": phase, "tier": tier, "sent": sum(o.status != -1 for o in group),
            "ok": len(ok), "success": round(len(ok) / max(1, sum(o.status != -1 for o in group)), 3),
            "429": sum(o.status == 429 for o in group),
            "503_ladder": sum(o.status == 503 and o.ladder for o in group),
            "503_queue": sum(o.status == 503 and not o.ladder for o in group),
            "shed_with_retry_after": sum(o.retry_after is not None for o in shed),
            "other": sum(o not in ok and o not in shed and o.status != -1 for o in group),
            "client_cap": sum(o.status == -1 for o in group),
            "max_degraded": max((o.degraded for o in group), default=0),
            "ttft_p50_ms": _ms(ttft, 50), "ttft_p95_ms": _ms(ttft, 95),
        })  # fmt: skip
    order = {p: i for i, p in enumerate(["baseline", "ramp", "hold", "after", "recovered"])}
    return sorted(
        rows, key=lambda r: (order.get(r["phase"], 9), ["enterprise", "plus", "free"].index(r["tier"]))
    )


def _table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def decision_lines(decisions: list[dict[str, Any]], t0: float) -> list[str]:
    return [
        f"t={d['at'] - t0:6.1f}s {d['action']:<10} {d['from']}->{d['to']} x{d['repeats']:<3} "
        f"[{d['outcome']}] {d['reason']}"
        for d in decisions
    ]


def ladder_lines(history: list[dict[str, Any]], t0: float) -> list[str]:
    return [f"t={e['at'] - t0:6.1f}s {e['from']}->{e['to']} ({e['actor']}) {e['reason']}" for e in history]


# -- the test ------------------------------------------------------------------------------------


def test_load_ramp_scales_out_degrades_sheds_free_and_recovers_by_itself(tmp_path) -> None:
    cp = Service(
        [
            "control-plane",
            "--admin-token",
            ADMIN_TOKEN,
            "--shard-log-dir",
            str(tmp_path),
            *CONTROL_PLANE_FLAGS,
        ]
    )
    cache = Service(["cache-node", "--registry", cp.url, "--node-id", "cache-ramp"])
    gw = Service(
        [
            "gateway",
            "--registry-url",
            cp.url,
            "--control-plane-url",
            cp.url,
            "--tokenizer",
            "whitespace",
            "--model-name",
            "synthetic",
        ],
        env={"SWITCHBOARD_GATEWAY_API_KEYS": _keys_env()},
    )
    with cp, cache:
        eventually(lambda: _serving(cp) == 1, 60, 0.25, what="the autoscaler's first shard serving")
        with gw:
            eventually(lambda: httpx.get(gw.url + "/health").json()["shards"] == 1, 20, 0.25,
                       what="the gateway sees the shard")
            ramp = Ramp(gw.url, cp.url)
            started = time.monotonic()
            asyncio.run(_run(ramp))
            took = time.monotonic() - started
            decisions = httpx.get(
                cp.url + "/admin/v1/decisions", params={"limit": 1000}, headers=ADMIN
            ).json()
            ladder = httpx.get(cp.url + "/admin/v1/degradation", headers=ADMIN).json()

    log, history = decisions["decisions"], ladder["history"]
    rows = figures(ramp.outcomes)
    print(f"\n== load ramp: {took:.0f}s, phases at {ramp.phase_at} (s since start)")
    print(
        "== decision log (action from->to xrepeats [outcome] reason)\n"
        + "\n".join(decision_lines(log, ramp.t0))
    )
    print("== degradation history (from->to (actor) reason)\n" + "\n".join(ladder_lines(history, ramp.t0)))
    print("== figures per phase\n" + _table(rows))
    print("== timeline (1 s; level, serving shards, signals)")
    for row in ramp.timeline:
        print(json.dumps(row))

    # (1) scaled out
    ups = [d for d in log if d["action"] == "scale_up" and d["outcome"] == "ok" and d["from"] >= 1]
    assert ups, "no scale_up under load"
    assert max(r.get("serving", 0) for r in ramp.timeline) > 1, "never more than one shard serving"
    # (2) degraded automatically to >= 3; free shed by the ladder with Retry-After; enterprise served
    raised = [e for e in history if e["to"] > e["from"] and e["actor"] == "auto"]
    assert max((e["to"] for e in raised), default=0) >= 3, ladder_lines(history, ramp.t0)
    loaded = [o for o in ramp.outcomes if o.phase in ("ramp", "hold")]
    free_ladder = [o for o in loaded if o.tier == "free" and o.status == 503 and o.ladder]
    assert free_ladder, "the free tier was never shed by the ladder"
    shed = [o for o in loaded if o.status in (429, 503)]
    assert all(o.retry_after for o in shed), Counter((o.tier, o.status) for o in shed if not o.retry_after)
    assert not [o for o in loaded if o.tier == "enterprise" and o.ladder], "enterprise shed by the ladder"
    ent = [o for o in loaded if o.tier == "enterprise" and o.status != -1]
    ent_ok = sum(o.status == 200 and o.code is None for o in ent)
    assert ent and ent_ok / len(ent) >= ENTERPRISE_MIN_SUCCESS, (
        ent_ok,
        len(ent),
        Counter(o.code for o in ent),
    )
    # (3) recovered by itself
    assert ramp.recovered(log), "ladder not back at 0 / fleet not back at 1 within the bound"
    assert history[-1]["to"] == 0 and history[-1]["actor"] == "auto"
    assert not any(e["actor"] == "operator" for e in history)
    after = [o for o in ramp.outcomes if o.phase == "recovered"]
    assert after and all(o.status == 200 and o.degraded == 0 for o in after), after


def _serving(cp: Service) -> int:
    members = httpx.get(cp.url + "/v1/registry/members", params={"service": "shard"}).json()["members"]
    return sum(m["status"] == "passing" for m in members)
