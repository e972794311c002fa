"""`switchboard bench multiturn --systems affinity,kv_aware`: KV-aware routing vs session hashing
when the fleet grows mid-conversation.

    flock /tmp/sb-bench.lock switchboard bench multiturn --systems affinity,kv_aware \\
        --conversations 4 --turns 8 --join-after 3 --shard-args "--kv-tier off" --json /tmp/mt-routing.json

Per system (the gateway's ``--routing-policy``) it starts a registry-backed stack on loopback —
a control plane (embedded registry), one cache node, one torch shard on the real model
(prefix caching on), one gateway watching the registry — and drives the conversations of
data_plane/bench/multiturn.py. After turn ``--join-after`` every conversation waits while a
second shard starts and registers (scale-out); then the turns go on. Session hashing
(``affinity``) moves about half the sessions to the new shard, where their whole history is
prefilled again; ``kv_aware`` keeps each on the shard holding its KV (the ring's move is
outweighed by the cached tokens). Rows as in bench multiturn, plus per system the first turn
after the join (TTFT p50, hit rate) and the turns served by the new shard. With KV blocks on the
cache nodes (the shards' KV tier) a moved session fetches its prefix there, so the policies differ
most with ``--shard-args "--kv-tier off"`` (a move recomputes the history).

Called by data_plane/bench/multiturn.py (``main``) when ``--systems`` names routing policies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.common import finish, fmt, format_table, machine_info, percentile
from data_plane.bench.multiturn import (
    BENCH_KEY,
    BLOCK,
    SYSTEM_PROMPT,
    Turn,
    stream_turn,
    turn_rows,
    user_message,
)
from data_plane.bench.overhead import Proc, switchboard_cmd
from data_plane.common.hop_auth import cluster_headers
from data_plane.common.http_server import free_port

ROUTING_SYSTEMS = ("affinity", "kv_aware")


class RoutingStack:
    """Control plane + cache node + shard-0 + gateway (``--routing-policy``); shard-1 joins later."""

    def __init__(self, policy: str, args: argparse.Namespace, logs: Path) -> None:
        self.token = secrets.token_hex(16)
        env = {"SWITCHBOARD_CLUSTER_TOKEN": self.token}
        cp = free_port()
        self.control = Proc(f"control-{policy}", switchboard_cmd(
            "control-plane", "--port", str(cp), "--admin-token", secrets.token_hex(8)), cp, "/health", logs, env=env)
        reg = self.control.url
        c = free_port()
        self.cache = Proc(f"cache-{policy}", switchboard_cmd("cache-node", "--port", str(c), "--registry-url", reg,
                                                             "--node-id", "cache-0"), c, "/health", logs, env=env)
        self.shards = [self._shard(policy, i, args, logs, env) for i in range(2)]
        g = free_port()
        self.gateway = Proc(f"gateway-{policy}", switchboard_cmd(
            "gateway", "--port", str(g), "--registry-url", reg, "--routing-policy", policy, "--usage-db", "off",
            "--state-dir", str(logs / f"state-{policy}"), "--first-token-timeout-s", "300"), g, "/health", logs,
            env={**env, "SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})

    def _shard(self, policy: str, i: int, args: argparse.Namespace, logs: Path, env: dict[str, str]) -> Proc:
        port = free_port()
        return Proc(f"shard{i}-{policy}", switchboard_cmd(
            "shard", "--port", str(port), "--registry-url", self.control.url, "--node-id", f"shard-{i}",
            "--prefix-caching", "on", "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--threads", str(args.threads), *shlex.split(getattr(args, "shard_args", "") or "")), port, "/health",
            logs, env=env)

    def start(self, timeout: float) -> None:
        self.control.start().wait_healthy(timeout)
        for p in (self.cache, self.shards[0], self.gateway):
            p.start()
        for p in (self.cache, self.shards[0], self.gateway):
            p.wait_healthy(timeout)
        self.wait_routable(1, timeout)

    def join(self, timeout: float) -> float:
        """Start shard-1 and wait until the gateway can route to it; returns the seconds it took."""
        t0 = time.perf_counter()
        self.shards[1].start().wait_healthy(timeout)
        self.wait_routable(2, timeout)
        return time.perf_counter() - t0

    def wait_routable(self, shards: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.control.url + "/v1/registry/members", timeout=2,
                              headers={"authorization": f"Bearer {self.token}"})
                passing = [m for m in r.json().get("members", []) if m["service"] == "shard"
                           and m.get("status") == "passing"]
                if len(passing) >= shards:
                    time.sleep(1.5)  # the gateway's blocking query returns on the change
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{shards} shard(s) not routable after {timeout:.0f} s")

    def served(self, i: int) -> float:
        total = 0.0
        for line in httpx.get(self.shards[i].url + "/metrics", timeout=10, headers=cluster_headers(self.token)).text.splitlines():
            if line.startswith("vllm:request_success_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        for p in (self.gateway, *reversed(self.shards), self.cache, self.control):
            if p.proc is not None:
                p.stop()


async def conversation(http: httpx.AsyncClient, url: str, c: int, args: argparse.Namespace,
                       arrived: asyncio.Queue[int], go: asyncio.Event) -> list[Turn]:
    headers = {"authorization": f"Bearer {BENCH_KEY}", "x-session-id": "new"}
    out: list[Turn] = []
    prev: Turn | None = None
    for i in range(args.turns):
        if i == args.join_after + 1:
            await arrived.put(c)
            await go.wait()
        messages = [{"role": "user", "content": user_message(c, i, args.user_tokens)}]
        if i == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        t = Turn(c, i)
        session = await stream_turn(http, url, {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                                                "stream": True, "stream_options": {"include_usage": True}},
                                    headers, t)
        if prev is not None and prev.error is None:
            held = prev.prompt_tokens + prev.completion_tokens - (prev.finish_reason == "length")
            t.ideal_cached = min(held, t.prompt_tokens - 1) // BLOCK * BLOCK
        out.append(t)
        if t.error or not session:
            if i <= args.join_after:
                await arrived.put(c)  # never leave the others waiting at the join
            break
        headers["x-session-id"] = session
        prev = t
    return out


async def drive(stack: RoutingStack, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    arrived: asyncio.Queue[int] = asyncio.Queue()
    go = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as http:
        warm = Turn(-1, -1)
        await stream_turn(http, stack.gateway.url, {"messages": [{"role": "user", "content": "Hello"}],
                                                    "max_tokens": 4, "stream": True},
                          {"authorization": f"Bearer {BENCH_KEY}"}, warm)
        if warm.error:
            raise RuntimeError(f"{policy}: the stack does not answer: {warm.error}")
        load0 = os.getloadavg()[0]
        tasks = [asyncio.create_task(conversation(http, stack.gateway.url, c, args, arrived, go))
                 for c in range(args.conversations)]
        for _ in range(args.conversations):
            await arrived.get()
        before = stack.served(0)
        join_s = await asyncio.to_thread(stack.join, args.startup_timeout)
        go.set()
        convs = await asyncio.gather(*tasks)
    turns = [t for conv in convs for t in conv]
    after = [t for t in turns if t.turn == args.join_after + 1 and t.error is None and t.ttft_s is not None]
    return {"turns": turns, "join_s": join_s, "load": [load0, os.getloadavg()[0]],
            "new_shard_turns": stack.served(1), "old_shard_turns_after_join": stack.served(0) - before,
            "after_join": {"ttft_p50_ms": percentile([t.ttft_s * 1000 for t in after if t.ttft_s], 50),
                           "hit_rate": sum(t.cached_tokens for t in after) / max(1, sum(t.prompt_tokens for t in after)),
                           "prefill_tokens_computed": sum(t.prompt_tokens - t.cached_tokens for t in after)}}


def run(args: argparse.Namespace, systems: list[str]) -> None:
    logs = Path(tempfile.mkdtemp(prefix="sb-multiturn-routing-"))
    machine = machine_info()
    result: dict[str, Any] = {"rows": [], "systems": {}, "turns": {}}
    for policy in systems:  # one stack at a time: the second shard competes for the same cores
        stack = RoutingStack(policy, args, logs)
        try:
            stack.start(args.startup_timeout)
            out = asyncio.run(drive(stack, policy, args))
        finally:
            stack.stop()
        turns = out.pop("turns")
        result["turns"][policy] = [t.__dict__ for t in turns]
        result["rows"] += turn_rows(policy, turns)
        result["systems"][policy] = out
        print(f"{policy}: join {out['join_s']:.0f} s, after it {out['new_shard_turns']:.0f} turns on the new shard; "
              f"load {out['load'][0]:.2f} -> {out['load'][1]:.2f}", flush=True)
    s = result["systems"]
    if "affinity" in s and "kv_aware" in s:
        a, k = s["affinity"]["after_join"], s["kv_aware"]["after_join"]
        result["summary"] = {"after_join_ttft_speedup": a["ttft_p50_ms"] / k["ttft_p50_ms"] if k["ttft_p50_ms"] else None,
                             "after_join_hit_rate": {"affinity": a["hit_rate"], "kv_aware": k["hit_rate"]}}
    result["machine"] = {**machine, "loadavg_end": list(os.getloadavg())}
    result["args"] = vars(args)
    print(format_table(["system", "turn", "history_tokens", "ttft_p50_ms", "ttft_p90_ms", "prefill_computed",
                        "hit_rate", "ideal_hit"],
                       [[r["system"], str(r["turn"]), str(r["history_tokens"]), fmt(r["ttft_p50_ms"], 0),
                         fmt(r["ttft_p90_ms"], 0), str(r["prefill_tokens_computed"]), f"{r['hit_rate']:.1%}",
                         f"{r['ideal_hit_rate']:.1%}"] for r in result["rows"]]))
    for policy, out in s.items():
        print(f"{policy}: first turn after the join: {json.dumps(out['after_join'])}; "
              f"turns on the new shard: {out['new_shard_turns']:.0f}")
    finish(result, logs, args.json)
