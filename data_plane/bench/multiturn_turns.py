"""The client side of `switchboard bench multiturn`: one streamed turn, one conversation, the per-turn rows.

    t = Turn(conversation=0, turn=0)
    session = await stream_turn(http, gateway_url, body, headers, t)      # fills t.ttft_s, usage
    turns = await conversation(http, gateway_url, c, args)                # args.turns turns, one session
    rows = turn_rows("on", turns)                                          # TTFT p50/p90, hit rate, ...

Used by data_plane/bench/multiturn.py (systems off/on) and data_plane/bench/multiturn_failover.py
(the session's shard killed mid-conversation, KV from the cache nodes or recomputed).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from data_plane.bench.common import percentile

BENCH_KEY = "sk-bench-multiturn-0123456789"
BLOCK = 16
SYSTEM_PROMPT = "You are a patient assistant who helps people plan trips, cook and fix things at home."
WORDS = ["river", "mountain", "kitchen", "bicycle", "window", "garden", "letter", "market", "station", "engine", "cloud", "harbour", "lantern", "library", "orchard", "bridge", "village", "candle", "forest", "ladder", "pocket", "stone", "winter", "summer", "morning", "evening", "journey", "recipe", "hammer", "pencil", "blanket", "mirror", "basket", "violin", "compass", "meadow", "castle", "tunnel", "island", "valley", "desert"]


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    ideal_cached: int = 0
    error: str | None = None


def user_message(conversation: int, turn: int, tokens: int) -> str:
    """About `tokens` tokens of plain words (~1.3 tokens a word), different per conversation and turn."""
    rng = random.Random(conversation * 1000 + turn)
    words = [rng.choice(WORDS) for _ in range(int(tokens / 1.3))]
    return f"Question {turn + 1}: I keep thinking about " + " ".join(words) + ". What would you suggest?"


async def stream_turn(http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                      t: Turn) -> str | None:
    """One streamed request; fills `t`; returns the session id the gateway answered with."""
    sent = time.perf_counter()
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            t.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content") and t.ttft_s is None:
                    t.ttft_s = time.perf_counter() - sent
                if choice.get("finish_reason"):
                    t.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage:
                t.prompt_tokens, t.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                t.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return r.headers.get("x-session-id")


async def conversation(http: httpx.AsyncClient, url: str, c: int, args: argparse.Namespace,
                       before_turn: Callable[[int], Awaitable[None]] | None = None) -> list[Turn]:
    """One session of `args.turns` turns; `before_turn(i)` is awaited before each (a barrier for
    the failover variant, data_plane/bench/multiturn_failover.py)."""
    headers = {"authorization": f"Bearer {BENCH_KEY}", "x-session-id": "new"}
    out: list[Turn] = []
    prev: Turn | None = None
    for i in range(args.turns):
        if before_turn is not None:
            await before_turn(i)
        messages = [{"role": "user", "content": user_message(c, i, args.user_tokens)}]
        if i == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t = Turn(c, i)
        session = await stream_turn(http, url, body, headers, t)
        if prev is not None and prev.error is None:
            held = prev.prompt_tokens + prev.completion_tokens - (prev.finish_reason == "length")
            t.ideal_cached = min(held, t.prompt_tokens - 1) // BLOCK * BLOCK
        out.append(t)
        if t.error or not session:
            if before_turn is not None:  # leave the barrier to the others
                for j in range(i + 1, args.turns):
                    await before_turn(-j)
            break
        headers["x-session-id"] = session
        prev = t
    return out


def turn_rows(system: str, turns: list[Turn]) -> list[dict[str, Any]]:
    rows = []
    for i in sorted({t.turn for t in turns}):
        ok = [t for t in turns if t.turn == i and t.error is None and t.ttft_s is not None]
        if not ok:
            continue
        ttfts = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
        prompt = sum(t.prompt_tokens for t in ok)
        rows.append({
            "system": system, "turn": i, "conversations": len(ok),
            "history_tokens": round(prompt / len(ok)),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
            "prefill_tokens_computed": round(sum(t.prompt_tokens - t.cached_tokens for t in ok) / len(ok)),
            "hit_rate": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
            "ideal_hit_rate": sum(t.ideal_cached for t in ok) / prompt if prompt else 0.0,
        })
    return rows


async def warm_up(http: httpx.AsyncClient, gateway_url: str, system: str) -> None:
    """One short turn through the gateway (lazy imports, first kernels); raises if the stack does not answer."""
    t = Turn(-1, -1)
    await stream_turn(http, gateway_url, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                                          "stream": True}, {"authorization": f"Bearer {BENCH_KEY}"}, t)
    if t.error:
        raise RuntimeError(f"{system}: the stack does not answer: {t.error}")
