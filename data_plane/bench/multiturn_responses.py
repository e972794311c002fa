"""`switchboard bench multiturn --api responses`: the follow-up-turn TTFT curve through the Responses
API (`previous_response_id`) next to the same conversations through sessions (`X-Session-Id`), in one run.

    flock /tmp/sb-bench.lock switchboard bench multiturn --api responses --conversations 8 --turns 8 \\
        --json /tmp/multiturn-responses.json --png docs/img/multiturn-responses.png

One stack (a torch shard with prefix caching on, a cache node, a gateway: data_plane/bench/multiturn.py's
`Stack`); `--conversations` session conversations and as many response chains run at the same time
against it, so machine drift and load land on both alike, in two rounds: started alternately,
sessions first in one and chains in the other (the conversation the shard takes up first runs
alone for a while). Both carry the same kind of turns
(`user_message`, the system prompt first; the chains use other conversation numbers, so no chain
reuses a session's cached prefix), streamed; TTFT is request sent -> first text delta
(`response.output_text.delta` for the Responses API). Rows per API and turn as `bench multiturn`'s;
`ratios` gives, per turn (history length), responses' TTFT p50 over sessions'; the target is
<= 1.1 at every history length (`summary.within_target`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.common import finish, fmt, format_table, machine_info
from data_plane.bench.multiturn_turns import (
    BENCH_KEY,
    BLOCK,
    SYSTEM_PROMPT,
    Turn,
    conversation,
    turn_rows,
    user_message,
    warm_up,
)

TARGET_RATIO = 1.1
ROUNDS = 2
CHAIN_OFFSET = 1000
"""Chains use conversation numbers from here: their turns differ from the sessions' (no shared prefix)."""


async def stream_response(http: httpx.AsyncClient, url: str, body: dict[str, Any], t: Turn) -> str | None:
    """One streamed `POST /v1/responses`; fills `t`; returns the response id (None on an error)."""
    sent = time.perf_counter()
    rid = None
    async with http.stream("POST", url + "/v1/responses", json=body,
                           headers={"authorization": f"Bearer {BENCH_KEY}"}) as r:
        if r.status_code != 200:
            t.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "response.output_text.delta" and event.get("delta") and t.ttft_s is None:
                t.ttft_s = time.perf_counter() - sent
            elif kind in ("response.completed", "response.incomplete"):
                response = event["response"]
                usage = response.get("usage") or {}
                t.prompt_tokens, t.completion_tokens = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
                t.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
                t.finish_reason = "length" if kind == "response.incomplete" else "stop"
                rid = response["id"]
            elif kind in ("response.failed", "error"):
                t.error = f"{kind}: {json.dumps(event)[:200]}"
    return None if t.error else rid


async def chain(http: httpx.AsyncClient, url: str, c: int, args: argparse.Namespace) -> list[Turn]:
    """One response chain of `args.turns` turns (each turn's `previous_response_id` the last one)."""
    out: list[Turn] = []
    prev: Turn | None = None
    previous_id: str | None = None
    for i in range(args.turns):
        items: list[dict[str, str]] = [{"role": "user", "content": user_message(c, i, args.user_tokens)}]
        if i == 0:
            items.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        body: dict[str, Any] = {"input": items, "max_output_tokens": args.max_tokens, "temperature": 0,
                                "stream": True}
        if previous_id:
            body["previous_response_id"] = previous_id
        t = Turn(c, i)
        previous_id = await stream_response(http, url, body, t)
        if prev is not None and prev.error is None:
            held = prev.prompt_tokens + prev.completion_tokens - (prev.finish_reason == "length")
            t.ideal_cached = min(held, t.prompt_tokens - 1) // BLOCK * BLOCK
        out.append(t)
        if previous_id is None:
            break
        prev = t
    return out


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per turn both APIs answered: history tokens of each, responses' TTFT p50 / sessions'."""
    by = {(r["system"], r["turn"]): r for r in rows}
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        s, r = by.get(("sessions", turn)), by.get(("responses", turn))
        if s is None or r is None or not s["ttft_p50_ms"]:
            continue
        out.append({"turn": turn, "history_tokens": {"sessions": s["history_tokens"],
                                                     "responses": r["history_tokens"]},
                    "ttft_p50_ms": {"sessions": s["ttft_p50_ms"], "responses": r["ttft_p50_ms"]},
                    "ratio": r["ttft_p50_ms"] / s["ttft_p50_ms"],
                    "hit_rate": {"sessions": s["hit_rate"], "responses": r["hit_rate"]}})
    return out


def summary(got: list[dict[str, Any]]) -> dict[str, Any]:
    follow = [x for x in got if x["turn"] > 0]
    if not follow:
        return {"follow_up_turns": 0}
    worst = max(follow, key=lambda x: x["ratio"])
    return {"follow_up_turns": len(follow), "worst_ratio": worst["ratio"], "worst_turn": worst["turn"],
            "target_ratio": TARGET_RATIO, "within_target": all(x["ratio"] <= TARGET_RATIO for x in follow)}


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as http:
        await warm_up(http, url, "responses")
        t = Turn(-1, -1)
        await stream_response(http, url, {"input": "Hello", "max_output_tokens": 4, "stream": True}, t)
        if t.error:
            raise RuntimeError(f"the Responses API does not answer: {t.error}")
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        n = args.conversations
        sessions: list[Turn] = []
        chains: list[Turn] = []
        for r in range(ROUNDS):  # started alternately, sessions first in one round and chains in the other:
            # the conversation the shard takes up first runs alone, and that must not always be one API's
            first, base = r % 2, r * args.conversations
            done = await asyncio.gather(*(
                conversation(http, url, base + c // 2, args) if c % 2 == first
                else chain(http, url, CHAIN_OFFSET + base + c // 2, args) for c in range(2 * n)))
            sessions += [t for conv in done[first::2] for t in conv]
            chains += [t for conv in done[1 - first::2] for t in conv]
        print(f"{len(sessions)} session turns and {len(chains)} response turns in {time.perf_counter() - t0:.0f} s "
              f"(load {load0:.2f} -> {os.getloadavg()[0]:.2f}), errors: "
              f"{sum(1 for t in sessions + chains if t.error)}", flush=True)
    rows = turn_rows("sessions", sessions) + turn_rows("responses", chains)
    return {"rows": rows, "turns": {"sessions": [t.__dict__ for t in sessions],
                                    "responses": [t.__dict__ for t in chains]}}


def run(args: argparse.Namespace) -> None:
    from data_plane.bench.multiturn import Stack, plot  # imported here: multiturn dispatches to this module

    logs = Path(tempfile.mkdtemp(prefix="sb-multiturn-responses-"))
    machine = machine_info()
    stack = Stack("on", args, logs)
    try:
        stack.start(args.startup_timeout)
        result = asyncio.run(measure(args, stack.gateway.url))
    finally:
        stack.stop()
    result["ratios"] = ratios(result["rows"])
    result["summary"] = summary(result["ratios"])
    result["machine"] = {**machine, "loadavg_end": list(os.getloadavg())}
    result["args"] = vars(args)
    print(format_table(["turn", "history (sessions/responses)", "ttft p50 sessions", "ttft p50 responses", "ratio",
                        "hit rate s/r"],
                       [[str(x["turn"]), f"{x['history_tokens']['sessions']}/{x['history_tokens']['responses']}",
                         fmt(x["ttft_p50_ms"]["sessions"], 0), fmt(x["ttft_p50_ms"]["responses"], 0),
                         f"{x['ratio']:.2f}", f"{x['hit_rate']['sessions']:.0%}/{x['hit_rate']['responses']:.0%}"]
                        for x in result["ratios"]]))
    finish(result, logs, args.json)
    if args.png:
        plot(result["rows"], args.png, f"sessions vs Responses API, {args.conversations} conversations each x "
             f"{args.turns} turns, {machine.get('cpu_model')}, {args.dtype}")
