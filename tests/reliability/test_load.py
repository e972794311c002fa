"""Load: twice the cluster's capacity with a tier mix for two minutes (slow; bounded; loopback only).

    .venv/bin/python -m pytest tests/reliability/test_load.py -q -s -m slow

Capacity is made finite and known: two synthetic shards announce 4 batch slots each, so the gateway
admits 8 requests at a time, and every reply is 16 tokens at 50 ms (0.8 s): about 10 requests/s.
The client offers ~2x that, open loop, for LOAD_S seconds:

- free  12/s over 20 keys (36 rpm each, under free's 60) - shed by admission when it waits too long
- plus   6/s over 4 keys
- enterprise 1/s stateless, plus 2 enterprise users each holding one conversation (a session),
  turn after turn (closed loop), whose transcripts are checked turn for turn at the end
- one abusive free key at 2/s (120 rpm, twice its limit): 429 when its requests get that far; under
  this load they are shed first (503) and shed requests are refunded to its rate limit

Pass: no process dies; every process's RSS grows by less than RSS_GROWTH_MIB; enterprise gets 100 %
answers with p95 latency under ENTERPRISE_P95_S; free is shed only with 429/503 + Retry-After;
nothing else fails; no enterprise turn is missing from its transcript.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import httpx
import pytest

from tests.reliability.common import ADMIN, all_services, report, rss_kb
from tests.support.cluster import Cluster, stored_session
from tests.support.metrics import metric
from tests.support.waits import eventually

pytestmark = pytest.mark.slow

LOAD_S = 120.0
"""How long the load is offered."""
TOKEN_DELAY_MS = 50
SLOTS_PER_SHARD = 4
RATES = {"free": 12.0, "plus": 6.0, "enterprise": 1.0, "abuser": 2.0}
"""Open-loop requests per second by stream."""
SESSION_USERS = 2
ENTERPRISE_P95_S = 2.5
"""Enterprise end-to-end p95 bound: 0.8 s of generation plus at most ~1.7 s of queueing."""
RSS_GROWTH_MIB = 64
MAX_OUTSTANDING = 400
"""Client-side cap on requests in flight, so an overloaded server cannot make the client grow."""

FREE_KEYS = [f"sk-load-free-{i:02d}-0123456789" for i in range(20)]
PLUS_KEYS = [f"sk-load-plus-{i}-0123456789" for i in range(4)]
ENT_KEYS = [f"sk-load-ent-{i}-0123456789" for i in range(2 + SESSION_USERS)]
ABUSER_KEY = "sk-load-abuser-0123456789"


def _keys_env() -> str:
    rows = [f"{k}:free-co:free" for k in FREE_KEYS + [ABUSER_KEY]]
    rows += [f"{k}:plus-co:plus" for k in PLUS_KEYS] + [f"{k}:big-co:enterprise" for k in ENT_KEYS]
    return ",".join(rows)


@dataclass
class Result:
    stream: str
    status: int
    seconds: float
    retry_after: str | None
    code: str | None


class Load:
    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[Result] = []
        self.turns: dict[str, int] = {}  # session id -> turns answered 200
        self.stop_at = 0.0

    async def _one(
        self,
        http: httpx.AsyncClient,
        stream: str,
        key: str,
        content: str,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response | None:
        t0 = time.monotonic()
        try:
            r = await http.post(
                self.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}", **(headers or {})},
                json={"messages": [{"role": "user", "content": content}], "max_tokens": 16},
            )
        except httpx.HTTPError as exc:
            self.results.append(Result(stream, 0, time.monotonic() - t0, None, type(exc).__name__))
            return None
        code = None
        if r.status_code != 200:
            try:
                code = r.json()["error"]["code"]
            except ValueError:
                code = "not_json"
        self.results.append(
            Result(stream, r.status_code, time.monotonic() - t0, r.headers.get("retry-after"), code)
        )
        return r

    async def _open_loop(
        self, http: httpx.AsyncClient, stream: str, keys: list[str], rate: float, sem: asyncio.Semaphore
    ) -> None:
        tasks, i, start = [], 0, time.monotonic()
        while time.monotonic() < self.stop_at:
            await sem.acquire()
            key = keys[i % len(keys)]

            async def fire(n: int = i, key: str = key) -> None:
                try:
                    await self._one(http, stream, key, f"{stream} question {n}")
                finally:
                    sem.release()

            tasks.append(asyncio.create_task(fire()))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)

    async def _conversation(self, http: httpx.AsyncClient, key: str) -> None:
        sid = "new"
        while time.monotonic() < self.stop_at:
            r = await self._one(http, "session", key, f"turn {self.turns.get(sid, 0)}", {"X-Session-Id": sid})
            if r is not None and r.status_code == 200:
                sid = r.headers["x-session-id"]
                self.turns[sid] = self.turns.get(sid, 0) + 1
            await asyncio.sleep(0.5)

    async def run(self, seconds: float) -> None:
        self.stop_at = time.monotonic() + seconds
        sem = asyncio.Semaphore(MAX_OUTSTANDING)
        limits = httpx.Limits(max_connections=MAX_OUTSTANDING, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
            await asyncio.gather(
                self._open_loop(http, "free", FREE_KEYS, RATES["free"], sem),
                self._open_loop(http, "plus", PLUS_KEYS, RATES["plus"], sem),
                self._open_loop(http, "enterprise", ENT_KEYS[:2], RATES["enterprise"], sem),
                self._open_loop(http, "abuser", [ABUSER_KEY], RATES["abuser"], sem),
                *(self._conversation(http, k) for k in ENT_KEYS[2:]),
            )


def _p(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return round(
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0],
        3,
    )


def test_twice_capacity_for_two_minutes_with_a_tier_mix() -> None:
    c = Cluster(
        shards=2, caches=2, token_delay_ms=TOKEN_DELAY_MS, shard_args=["--max-num-seqs", str(SLOTS_PER_SHARD)]
    )
    c.gateway.env["SWITCHBOARD_GATEWAY_API_KEYS"] = _keys_env()
    c.control_plane.args += ["--degradation-lower-dwell", "5"]  # so the ladder comes down soon after
    with c:
        procs = {f"{s.args[3]}:{s.port}": s for s in all_services(c)}
        rss_before = {name: rss_kb(s.proc.pid) for name, s in procs.items()}
        rss_max = dict(rss_before)
        levels: set[int] = set()
        done = threading.Event()

        def sample() -> None:  # RSS and the degradation level every 2 s while the load runs
            while not done.wait(2.0):
                for name, s in procs.items():
                    if s.proc.poll() is None:
                        rss_max[name] = max(rss_max[name], rss_kb(s.proc.pid))
                try:
                    levels.add(
                        httpx.get(c.control_plane.url + "/admin/v1/degradation", headers=ADMIN).json()[
                            "level"
                        ]
                    )
                except httpx.HTTPError:
                    pass

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        load = Load(c.gateway.url)
        t0 = time.monotonic()
        try:
            asyncio.run(load.run(LOAD_S))
        finally:
            done.set()
            sampler.join(10)
        wall = time.monotonic() - t0

        crashed = [name for name, s in procs.items() if s.proc.poll() is not None]
        assert not crashed, crashed
        rss_after = {name: rss_kb(s.proc.pid) for name, s in procs.items()}
        by_stream: dict[str, Counter] = defaultdict(Counter)
        latencies: dict[str, list[float]] = defaultdict(list)
        for r in load.results:
            by_stream[r.stream][f"{r.status} {r.code or 'ok'}"] += 1
            if r.status == 200:
                latencies[r.stream].append(r.seconds)
        # Nothing lost: every enterprise turn answered 200 is in its transcript (user + assistant each).
        lost_turns = 0
        for sid, turns in load.turns.items():
            stored = [stored_session(n.url, sid) or {} for n in c.caches]
            kept = max((len(s.get("messages", [])) for s in stored), default=0)
            lost_turns += max(0, turns - kept // 2)
        ok = sum(v for counts in by_stream.values() for k, v in counts.items() if k.startswith("200"))
        report(
            "load_2x_capacity",
            offered_per_s=round(sum(RATES.values()) + SESSION_USERS / 1.3, 1),
            capacity_per_s=2 * SLOTS_PER_SHARD / (16 * TOKEN_DELAY_MS / 1000),
            seconds=round(wall, 1),
            requests=len(load.results),
            answered_200=ok,
            served_per_s=round(ok / LOAD_S, 2),
            outcomes={k: dict(v) for k, v in by_stream.items()},
            p50_s={k: _p(v, 50) for k, v in latencies.items()},
            p95_s={k: _p(v, 95) for k, v in latencies.items()},
            degradation_levels_seen=sorted(levels),
            session_turns=sum(load.turns.values()),
            lost_turns=lost_turns,
            rss_mib={
                n: [round(rss_before[n] / 1024), round(rss_max[n] / 1024), round(rss_after[n] / 1024)]
                for n in procs
            },
            shed=metric(c.gateway.url, "switchboard_admission_shed_total"),
        )

        for stream in ("enterprise", "session"):
            assert set(by_stream[stream]) == {"200 ok"}, (stream, by_stream[stream])
        assert _p(latencies["enterprise"] + latencies["session"], 95) < ENTERPRISE_P95_S
        assert lost_turns == 0
        shed = [r for r in load.results if r.stream in ("free", "abuser") and r.status != 200]
        assert shed, "free was never shed: the load did not exceed capacity"
        assert {r.status for r in shed} <= {429, 503}, Counter((r.status, r.code) for r in shed)
        assert all(r.retry_after and int(r.retry_after) >= 1 for r in shed)
        others = [r for r in load.results if r.status not in (200, 429, 503)]
        assert not others, Counter((r.stream, r.status, r.code) for r in others)
        assert all(r.stream in ("free", "abuser", "plus") for r in load.results if r.status != 200)
        for name in procs:
            assert rss_after[name] - rss_before[name] < RSS_GROWTH_MIB * 1024, (
                name,
                rss_before[name],
                rss_after[name],
            )
        # Afterwards: serving as normal once the ladder comes down.
        # (the signals are rates over a 30 s window, then one step down per 5 s of calm)
        recovered_s = eventually(
            lambda: (
                httpx.get(c.control_plane.url + "/admin/v1/degradation", headers=ADMIN).json()["level"] == 0
            ),
            120.0,
            1.0,
            what="degradation back to 0",
        )
        report("load_recovery", degradation_back_to_0_after_s=round(recovered_s, 1))
        r = httpx.post(
            c.gateway.url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {FREE_KEYS[0]}"},
            json={"messages": [{"role": "user", "content": "after"}], "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
