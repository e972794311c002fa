"""`switchboard bench memory`: does context outlive the window? Long conversations with a fact
planted early and asked about late, with recall on and off.

    switchboard bench memory --conversations 4 --turns 120 --json /tmp/memory.json     # starts a stack
    switchboard bench memory --url http://127.0.0.1:8000 --api-key KEY --conversations 4
    switchboard bench memory --recall-only --conversations 200                         # no model at all

Each conversation (generated, seeded) has `--turns` user/assistant turns of small talk, far past
the model's window, and one planted fact ("My locker code is 4417.") in its first quarter; the
last message asks for it. Two measures:

- **retrieval recall**: the share of questions whose planted turn is in the context sent to the
  model. It is computed with the gateway's own code (data_plane/gateway/memory.py
  `fit_with_recall`, the model's tokenizer, the same budget), with recall and with the plain
  sliding window.
- **answer accuracy** (not with `--recall-only`): each conversation is stored twice through the
  Conversations API and the question asked with `truncation: "auto"`, once with recall and once
  without (`context_recall: false`), greedy, through a real gateway and the real model; an answer
  is correct when it contains the planted value.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from data_plane.bench.common import format_table, machine_info, write_json
from data_plane.gateway.context import DEFAULT_TRIM_STEP_SHARE

FACTS = (
    ("My locker code is {n}.", "What is my locker code?", "{n}"),
    ("My sister is called {name}.", "What is my sister called?", "{name}"),
    ("I parked the car on level {d} of the garage.", "On which level of the garage did I park the car?", "{d}"),
    ("The wifi password at the cabin is {word}{d}.", "What is the wifi password at the cabin?", "{word}{d}"),
    ("My dentist appointment is on {day}.", "On which day is my dentist appointment?", "{day}"),
)
NAMES = ("Marguerite", "Odalys", "Thaddea", "Quintessa", "Rosalind", "Isolde", "Perpetua")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
WORDS = ("falcon", "harbor", "quartz", "meadow", "saffron", "juniper", "cobalt")
FILLER_NOUNS = ("river", "mountain", "kitchen", "bicycle", "window", "market", "station", "cloud", "lantern",
                "forest", "bread", "novel", "guitar", "ocean", "bridge", "museum", "festival", "recipe", "train")
FILLER_VERBS = ("visited", "painted", "cleaned", "photographed", "described", "imagined", "repaired", "watched")
FILLER_ADJ = ("quiet", "bright", "old", "busy", "colorful", "small", "windy", "lovely")


@dataclass(frozen=True)
class Planted:
    """One generated conversation: its turns (user/assistant messages), the question and the answer."""

    messages: list[dict[str, str]]
    planted_index: int
    """Index in `messages` of the user message holding the fact."""
    question: str
    answer: str


def _filler(rng: random.Random) -> tuple[str, str]:
    def sentence() -> str:
        return (f"Yesterday I {rng.choice(FILLER_VERBS)} the {rng.choice(FILLER_ADJ)} {rng.choice(FILLER_NOUNS)} "
                f"near the {rng.choice(FILLER_NOUNS)} with a friend from the {rng.choice(FILLER_NOUNS)}.")
    user = " ".join(sentence() for _ in range(2))
    reply = (f"That sounds {rng.choice(FILLER_ADJ)}. Did the {rng.choice(FILLER_NOUNS)} remind you of the "
             f"{rng.choice(FILLER_NOUNS)} you {rng.choice(FILLER_VERBS)} last year?")
    return user, reply


def generate(seed: int, turns: int) -> Planted:
    """A conversation of `turns` turns with one fact planted in its first quarter (deterministic per seed)."""
    rng = random.Random(seed)
    fact, question, answer = FACTS[seed % len(FACTS)]
    values = {"n": str(rng.randint(1000, 9999)), "name": rng.choice(NAMES), "d": str(rng.randint(2, 9)),
              "word": rng.choice(WORDS), "day": rng.choice(DAYS)}
    at = rng.randint(1, max(1, turns // 4))
    messages: list[dict[str, str]] = []
    planted = 0
    for t in range(turns):
        user, reply = _filler(rng)
        if t == at:
            planted = len(messages)
            user = fact.format(**values) + " " + user
            reply = "Got it, I will remember that. " + reply
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return Planted(messages, planted, question, answer.format(**values))


def retrieval(p: Planted, counter: Any, budget: int, step: int = 0) -> dict[str, bool]:
    """Whether the planted turn is in the context sent to the model, with and without recall (the
    window dropping `step` tokens at a time, as the gateway's --context-trim-step does)."""
    from data_plane.gateway.context import fit_window
    from data_plane.gateway.memory import fit_with_recall

    prompt = [*p.messages, {"role": "user", "content": p.question}]
    fact = p.messages[p.planted_index]["content"].split(".")[0]
    window = fit_window(prompt, counter, budget, step)
    recalled, _ = fit_with_recall(prompt, [], counter, budget, step)
    return {"window": any(fact in m["content"] for m in window.messages),
            "recall": any(fact in m["content"] for m in recalled.messages)}


async def ask(http: httpx.AsyncClient, url: str, key: str, p: Planted, recall: bool, max_tokens: int) -> str:
    headers = {"authorization": f"Bearer {key}"}
    items = [{"type": "message", **m} for m in p.messages]
    conv = await http.post(url + "/v1/conversations", headers=headers, json={"items": items[:20]})
    conv.raise_for_status()
    conv_id = conv.json()["id"]
    for start in range(20, len(items), 20):  # OpenAI's limit: 20 items an add
        (await http.post(f"{url}/v1/conversations/{conv_id}/items", headers=headers,
                         json={"items": items[start:start + 20]})).raise_for_status()
    r = await http.post(url + "/v1/responses", headers=headers, json={
        "input": p.question, "conversation": conv_id, "truncation": "auto", "context_recall": recall,
        "temperature": 0, "max_output_tokens": max_tokens, "store": False})
    r.raise_for_status()
    out = r.json()["output"]
    return "".join(part["text"] for item in out if item["type"] == "message" for part in item["content"])


async def accuracy(args: argparse.Namespace, convs: list[Planted], url: str, key: str) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(timeout=600) as http:
        for i, p in enumerate(convs):
            for recall in (True, False):
                started = time.perf_counter()
                try:
                    text, error = await ask(http, url, key, p, recall, args.max_tokens), None
                except httpx.HTTPError as exc:  # the row says FAILED; the run goes on
                    text, error = "", f"FAILED: {exc}"
                rows.append({"conversation": i, "recall": recall, "answer": p.answer, "output": text,
                             "correct": error is None and p.answer.lower() in text.lower(), "error": error,
                             "seconds": round(time.perf_counter() - started, 2)})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from data_plane.gateway.context import TokenCounter, trim_step

    counter = TokenCounter.for_model(None)
    budget = args.context - args.max_tokens - 32  # the gateway's TEMPLATE_SLACK_TOKENS
    step = trim_step(args.context, args.context_trim_step)
    convs = [generate(args.seed + i, args.turns) for i in range(args.conversations)]
    found = [retrieval(p, counter, budget, step) for p in convs]
    history = [counter.prompt_tokens(p.messages) for p in convs]
    result: dict[str, Any] = {
        "machine": machine_info(), "conversations": len(convs), "turns": args.turns,
        "history_tokens_mean": round(sum(history) / len(history)), "budget_tokens": budget,
        "retrieval_recall": {"sliding_window": sum(f["window"] for f in found) / len(found),
                             "with_recall": sum(f["recall"] for f in found) / len(found)},
    }
    if not args.recall_only:
        if args.url:
            rows = asyncio.run(accuracy(args, convs, args.url.rstrip("/"), args.api_key))
        else:
            rows = _with_stack(args, convs)
        result["answers"] = rows
        result["accuracy"] = {mode: sum(r["correct"] for r in rows if r["recall"] is on) / len(convs)
                              for mode, on in (("with_recall", True), ("sliding_window", False))}
        result["failed"] = sum(1 for r in rows if r["error"])
    return result


def _with_stack(args: argparse.Namespace, convs: list[Planted]) -> list[dict[str, Any]]:
    from data_plane.bench.multiturn import Stack
    from data_plane.bench.multiturn_turns import BENCH_KEY

    logs = Path(tempfile.mkdtemp(prefix="sb-bench-memory-"))
    stack = Stack("on", args, logs)
    try:
        stack.start(300)
        return asyncio.run(accuracy(args, convs, stack.gateway.url, BENCH_KEY))
    finally:
        stack.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="switchboard bench memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=120, help="turns per conversation (>= 100 to pass the window)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--context", type=int, default=2048, help="the model's window, as the gateway sees it")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--context-trim-step", type=float, default=DEFAULT_TRIM_STEP_SHARE,
                    help="the gateway's --context-trim-step (share of the context the window drops at a time)")
    ap.add_argument("--recall-only", action="store_true", help="retrieval recall only: no model, no stack")
    ap.add_argument("--url", help="a running gateway (else a stack is started: shard, cache node, gateway)")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    rr = result["retrieval_recall"]
    rows = [["sliding window", f"{rr['sliding_window']:.0%}", ""], ["with recall", f"{rr['with_recall']:.0%}", ""]]
    if "accuracy" in result:
        rows[0][2] = f"{result['accuracy']['sliding_window']:.0%}"
        rows[1][2] = f"{result['accuracy']['with_recall']:.0%}"
    print(f"{result['conversations']} conversations of {result['turns']} turns "
          f"(~{result['history_tokens_mean']} tokens each; {result['budget_tokens']} fit the window)")
    print(format_table(["context", "retrieval recall", "answer accuracy"], rows))
    if result.get("failed"):
        print(f"{result['failed']} request(s) FAILED (counted as wrong answers): see the JSON rows")
    if args.json:
        write_json(args.json, result)
