"""`switchboard bench multiturn --systems failover,failover-off`: rows (c) and (c') of issue 11.

    flock /tmp/sb-bench.lock switchboard bench multiturn --systems failover,failover-off \\
        --conversations 4 --turns 7 --failover-turn 5 --json /tmp/mt-failover.json

Per system it starts a registry-backed stack on loopback: a control plane (embedded registry), one
cache node, two torch shards on the real model (``--kv-tier on`` for ``failover``, ``off`` for
``failover-off``), a gateway watching the registry. Shard B starts drained, so every conversation
of data_plane/bench/multiturn_turns.py runs its first turns on shard A (with prefix caching, and with
its blocks going to the cache node when the tier is on). Before turn ``--failover-turn`` every
conversation waits; shard B is undrained and shard A is killed (SIGKILL), and once the gateway
routes to B alone the turns go on: (c) B fetches each conversation's KV from the cache node,
(c') B prefills the whole history again. Reported per turn as in bench multiturn; the summary
compares TTFT p50 at the failover turn, (c') / (c).

Before the kill the bench waits until shard A's offload counters are still for 0.5 s (at most
10 s): what a clean drain would give. After a real crash the blocks of a turn still in flight
are lost and that session recomputes its last turn's blocks only.

Called by data_plane/bench/multiturn.py (``main``) when ``--systems`` names these systems.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.multiturn_turns import BENCH_KEY, conversation, turn_rows, warm_up
from data_plane.bench.overhead import Proc, switchboard_cmd
from data_plane.common.hop_auth import cluster_headers
from data_plane.common.http_server import free_port

FAILOVER_SYSTEMS = {"failover": "on", "failover-off": "off"}
"""System name -> the shards' --kv-tier."""
LABELS = {"failover": "(c) shard killed, KV from the cache nodes", "failover-off": "(c') shard killed, recompute"}
ADMIN_TOKEN = "bench-admin-token"
CLUSTER_TOKEN = "bench-cluster-token"


class FailoverStack:
    """Control plane, one cache node, shards A and B, a gateway; B starts drained."""

    def __init__(self, system: str, args: argparse.Namespace, logs: Path) -> None:
        env = {"SWITCHBOARD_CLUSTER_TOKEN": CLUSTER_TOKEN}
        cp, cache, gw = free_port(), free_port(), free_port()
        self.registry = f"http://127.0.0.1:{cp}"
        self.control = Proc(f"control-{system}", switchboard_cmd(
            "control-plane", "--port", str(cp), "--admin-token", ADMIN_TOKEN), cp, "/health", logs, env=env)
        self.cache = Proc(f"cache-{system}", switchboard_cmd(
            "cache-node", "--port", str(cache), "--registry-url", self.registry, "--node-id", f"cache-{system}"),
            cache, "/health", logs, env=env)
        self.shards: dict[str, Proc] = {}
        for name in ("a", "b"):
            port = free_port()
            self.shards[name] = Proc(f"shard-{name}-{system}", switchboard_cmd(
                "shard", "--port", str(port), "--registry-url", self.registry, "--node-id", f"shard-{name}",
                "--kv-tier", FAILOVER_SYSTEMS[system], "--dtype", args.dtype, "--max-num-seqs",
                str(args.max_num_seqs), "--threads", str(args.threads)), port, "/health", logs, env=env)
        self.gateway = Proc(f"gateway-{system}", switchboard_cmd(
            "gateway", "--port", str(gw), "--registry-url", self.registry, "--usage-db", "off",
            "--state-dir", str(logs / f"state-{system}"), "--first-token-timeout-s", "300"), gw, "/health", logs,
            env={**env, "SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})
        self.procs = [self.control, self.cache, *self.shards.values(), self.gateway]

    def start(self, timeout: float) -> None:
        self.control.start()
        self.control.wait_healthy(timeout)
        for p in self.procs[1:]:
            p.start()
        for p in self.procs[1:]:
            p.wait_healthy(timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def _admin(stack: FailoverStack, member: str, action: str) -> None:
    r = httpx.post(f"{stack.registry}/admin/v1/members/{member}/{action}",
                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    r.raise_for_status()


def _routable_shards(stack: FailoverStack) -> float:
    for line in httpx.get(stack.gateway.url + "/metrics", timeout=10, headers=cluster_headers(CLUSTER_TOKEN)).text.splitlines():
        if line.startswith('switchboard_gateway_members{service="shard"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def _scrape(url: str, prefix: str) -> float:
    total = 0.0
    try:
        text = httpx.get(url + "/metrics", timeout=10, headers=cluster_headers(CLUSTER_TOKEN)).text
    except httpx.HTTPError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _offload_settled(url: str) -> None:
    """Until shard A's stored-bytes counter has not moved for 0.5 s (at most 10 s)."""
    last, still_since, deadline = None, time.monotonic(), time.monotonic() + 10
    while time.monotonic() < deadline:
        now = await asyncio.to_thread(_scrape, url, "vllm:kv_offload_store_bytes_total")
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= 0.5:
            return
        await asyncio.sleep(0.1)


async def measure_failover(args: argparse.Namespace, system: str, stack: FailoverStack) -> dict[str, Any]:
    a, b = stack.shards["a"], stack.shards["b"]
    k = args.failover_turn if args.failover_turn is not None else max(1, args.turns - 2)
    _admin(stack, "shard-b", "drain")
    await _until(lambda: _routable_shards(stack) == 1, 30, "shard B drained")
    async with httpx.AsyncClient(timeout=600) as http:
        for shard in (a, b):  # warm-up: lazy imports, first kernels (B directly: it is drained)
            r = await http.post(shard.url + "/v1/chat/completions", headers={"authorization": f"Bearer {CLUSTER_TOKEN}"},
                                json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
            r.raise_for_status()
        await warm_up(http, stack.gateway.url, system)
        arrived, released = 0, asyncio.Event()
        moved: dict[str, Any] = {}

        async def before_turn(i: int) -> None:
            nonlocal arrived
            if abs(i) != k:  # -k: a conversation that ended early passes the barrier
                return
            arrived += 1
            if arrived == args.conversations:
                await _offload_settled(a.url)
                moved["offloaded_bytes"] = _scrape(a.url, "vllm:kv_offload_store_bytes_total")
                _admin(stack, "shard-b", "undrain")
                await _until(lambda: _routable_shards(stack) == 2, 30, "shard B routable")
                t0 = time.perf_counter()
                assert a.proc is not None
                a.proc.kill()  # SIGKILL: no drain, no deregistration
                await _until(lambda: _routable_shards(stack) == 1, 30, "shard A out of routing")
                moved["gone_after_s"] = time.perf_counter() - t0
                released.set()
            elif i >= 0:
                await released.wait()

        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(conversation(http, stack.gateway.url, c, args, before_turn)
                                       for c in range(args.conversations)))
        turns = [t for conv in convs for t in conv]
        print(f"{system}: {len(turns)} turns in {time.perf_counter() - t0:.0f} s (load {load0:.2f} -> "
              f"{os.getloadavg()[0]:.2f}), errors: {sum(1 for t in turns if t.error)}", flush=True)
        shard_b = {name: _scrape(b.url, name) for name in (
            "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
            "vllm:kv_offload_load_bytes_total", "vllm:kv_offload_load_time_total")}
    return {"rows": turn_rows(system, turns), "turns": [t.__dict__ for t in turns], "failover_turn": k,
            "shard_b": shard_b, **moved}


def run_failover(args: argparse.Namespace, systems: list[str], logs: Path) -> dict[str, Any]:
    """Each system's stack in turn (started, measured, stopped): rows, raw turns, summary."""
    out: dict[str, Any] = {"rows": [], "turns": {}, "failover": {}}
    for system in systems:
        stack = FailoverStack(system, args, logs)
        try:
            stack.start(args.startup_timeout)
            got = asyncio.run(measure_failover(args, system, stack))
        finally:
            stack.stop()
        out["rows"] += got.pop("rows")
        out["turns"][system] = got.pop("turns")
        out["failover"][system] = got
    by = {(r["system"], r["turn"]): r for r in out["rows"]}
    first: dict[str, Any] = next(iter(out["failover"].values()), {})
    k = first.get("failover_turn")
    if ("failover", k) in by and ("failover-off", k) in by:
        c, c_off = by[("failover", k)], by[("failover-off", k)]
        out["summary"] = {"failover_turn": k, "failover_history_tokens": c["history_tokens"],
                          "failover_ttft_p50_ms": {"c": c["ttft_p50_ms"], "c_prime": c_off["ttft_p50_ms"]},
                          "failover_ttft_speedup": c_off["ttft_p50_ms"] / c["ttft_p50_ms"],
                          "failover_hit_rate": {"c": c["hit_rate"], "c_prime": c_off["hit_rate"]}}
    return out
