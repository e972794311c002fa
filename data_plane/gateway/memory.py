"""Context that outlives the window: recall of the earlier turns most relevant to the new message,
and compaction (an item that stands for earlier context).

    recalled = recall(candidates, query="What is my locker code?", counter=counter, budget=256)
    recalled.message        # one system message quoting the best-matching earlier turns, or None
    done = compact(items, 512, counter, seal=seal, unseal=unseal, to_messages=items_to_messages, item_id=...)
    done.item               # {"type": "compaction", "encrypted_content": ...}; done.kept: the newest items
    turns, summary = open_compaction(item.item["encrypted_content"], unseal)

Recall scores earlier turns (a user message with the replies that follow it) against the new
message with BM25 over lowercase word terms (no model, no download), and re-injects the best
ones (their sentences that share a term with the new message), oldest first, within a token
budget, as one system message right before the new message. Its candidates are only ever the request's own
conversation: the turns its window dropped and the turns held by compaction items in its own
input or history. A compaction item is the earlier turns themselves plus an extractive summary,
sealed (AES-GCM, data_plane/common/crypto.py) and bound to the API key that made it: the model
sees the summary, recall draws from the turns, and another key's item does not open (400).
"""

from __future__ import annotations

import math
import re
from collections import Counter as Bag
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from data_plane.common.errors import ContextLengthExceeded
from data_plane.gateway.context import TokenCounter, Window, fit_window

RECALL_BUDGET_TOKENS = 256
"""At most this many prompt tokens go to recalled turns (a quarter of the budget when that is less)."""
MAX_RECALLED_TURNS = 4
SUMMARY_TOKENS = 160
RECALL_HEADER = "Earlier in this conversation (recalled):"
SUMMARY_HEADER = "Summary of the earlier conversation:"
_STOP = ("a an and are as at be but by can could did do does for from had has have how i if in is it its me my "
         "of on or our so than that the their them then there these they this to was we were what when where "
         "which who why will with would you your yours please tell know remember")
STOPWORDS = frozenset(_STOP.split(" "))
_WORD = re.compile(r"[a-z0-9]+")


def terms(text: str) -> list[str]:
    return [t for t in _WORD.findall(text.lower()) if t not in STOPWORDS]


@dataclass(frozen=True)
class Turn:
    """A user message and the messages that answer it, in order."""

    messages: tuple[dict[str, Any], ...]

    @property
    def text(self) -> str:
        return "\n".join(f"{m['role'].capitalize()}: {m.get('content') or ''}" for m in self.messages)


def turns_of(messages: Sequence[dict[str, Any]]) -> list[Turn]:
    out: list[list[dict[str, Any]]] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "user" or not out:
            out.append([m])
        else:
            out[-1].append(m)
    return [Turn(tuple(t)) for t in out]


def bm25(docs: Sequence[Sequence[str]], query: Sequence[str], k1: float = 1.2, b: float = 0.75) -> list[float]:
    """Okapi BM25 score of each doc for `query` (terms)."""
    n = len(docs)
    if not n:
        return []
    avg = sum(len(d) for d in docs) / n or 1.0
    df: Bag[str] = Bag()
    for d in docs:
        df.update(set(d))
    scores = []
    for d in docs:
        tf = Bag(d)
        s = 0.0
        for q in set(query):
            if q in tf:
                idf = math.log(1 + (n - df[q] + 0.5) / (df[q] + 0.5))
                s += idf * tf[q] * (k1 + 1) / (tf[q] + k1 * (1 - b + b * len(d) / avg))
        scores.append(s)
    return scores


@dataclass(frozen=True)
class Recall:
    message: dict[str, str] | None
    """One system message quoting the recalled turns, or None when nothing was relevant."""
    turns: int
    candidates: int
    tokens: int


def recall(candidates: Sequence[dict[str, Any]], query: str, counter: TokenCounter, budget: int) -> Recall:
    """The earlier turns of `candidates` most relevant to `query`, as one message within `budget` tokens."""
    turns = turns_of(candidates)
    scores = bm25([terms(t.text) for t in turns], terms(query))
    ranked = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: -scores[i])[:MAX_RECALLED_TURNS]
    chosen: dict[int, str] = {}
    used = counter.message_tokens({"role": "system", "content": RECALL_HEADER})
    wanted = set(terms(query))
    for i in ranked:
        text = _relevant_sentences(turns[i], wanted)
        cost = counter.count(text) + 2
        if used + cost <= budget:
            chosen[i] = text
            used += cost
    if not chosen:
        return Recall(None, 0, len(turns), 0)
    body = "\n".join([RECALL_HEADER, *(chosen[i] for i in sorted(chosen))])
    message = {"role": "system", "content": body}
    return Recall(message, len(chosen), len(turns), counter.message_tokens(message))


def fit_with_recall(prompt: Sequence[dict[str, Any]], memory: Sequence[dict[str, Any]], counter: TokenCounter,
                    budget: int, step: int = 0) -> tuple[Window, Recall | None]:
    """The sliding window over `prompt` within `budget` tokens (dropping `step` tokens at a time,
    data_plane/gateway/context.py), with the earlier turns most relevant to its last user message
    recalled (from what the window dropped and from `memory`, the turns of its compaction items) into
    a quarter of the budget at most. Recall is None when nothing was lost.

    The window of a conversation that lost turns is fitted into the budget less the recall's whole
    reserve, whatever the recall then fills, so the cut depends only on the conversation, the budget
    and the step: it stays put from turn to turn as the plain window's does."""
    window = fit_window(prompt, counter, budget, step)
    if not (window.dropped or memory):
        return window, None
    reserve = min(RECALL_BUDGET_TOKENS, budget // 4)
    try:
        window = fit_window(prompt, counter, budget - reserve, step)
    except ContextLengthExceeded:  # the system prompt and the new message fit, but not with a reserve
        return window, None
    kept = {id(m) for m in window.messages}
    candidates = [*memory, *(m for m in prompt if id(m) not in kept)]
    query = next((m.get("content") or "" for m in reversed(prompt) if m["role"] == "user"), "")
    found = recall(candidates, query, counter, reserve)
    if found.message is None:
        return window, found
    # right before the new message: next to the question, and the window's prefix (its KV) stays as it was
    messages = list(window.messages)
    at = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages))
    messages.insert(at, found.message)
    return Window(messages, window.prompt_tokens + found.tokens, window.dropped, window.cut_moved), found


def fit_turn(prompt: Sequence[dict[str, Any]], memory: Sequence[dict[str, Any]], counter: TokenCounter, budget: int,
             step: int, truncation: str | None, with_recall: bool) -> tuple[Window, Recall | None]:
    """A Responses turn's prompt within `budget` tokens, as its `truncation` asks: "auto" drops the oldest
    turns (the sliding window, `fit_with_recall` unless `with_recall` is off); otherwise the whole conversation
    or a 400 context_length_exceeded naming `input`. Used alike by `POST /v1/responses` and its input_tokens
    count (data_plane/gateway/responses_count.py), so a count is what the create sends."""
    if truncation != "auto":
        total = counter.prompt_tokens(prompt)
        if total > budget:
            raise ContextLengthExceeded(
                f"the conversation is {total} tokens, over the {budget} this request leaves for input; "
                "set truncation to 'auto' to drop (and recall) earlier turns", param="input")
        return Window(list(prompt), total, 0), None
    if not with_recall:
        return fit_window(prompt, counter, budget, step), None
    return fit_with_recall(prompt, memory, counter, budget, step)


def _relevant_sentences(turn: Turn, wanted: set[str]) -> str:
    """The turn's sentences that share a term with the query (the whole turn if none does)."""
    lines = []
    for m in turn.messages:
        sentences = re.split(r"(?<=[.!?])\s+", (m.get("content") or "").strip())
        keep = [s for s in sentences if wanted & set(terms(s))]
        if keep:
            lines.append(f"{m['role'].capitalize()}: {' '.join(keep)}")
    return "\n".join(lines) or turn.text


def summary(messages: Sequence[dict[str, Any]], counter: TokenCounter, budget: int = SUMMARY_TOKENS) -> str:
    """An extractive summary: the first sentence of each earlier user message, newest kept first."""
    lines: list[str] = []
    used = counter.count(SUMMARY_HEADER)
    for m in reversed([m for m in messages if m["role"] == "user"]):
        first = re.split(r"(?<=[.!?])\s", (m.get("content") or "").strip(), maxsplit=1)[0][:200]
        cost = counter.count(first) + 2
        if not first or used + cost > budget:
            break
        lines.append("- " + first)
        used += cost
    return "\n".join([SUMMARY_HEADER, *reversed(lines)])


@dataclass(frozen=True)
class Compaction:
    item: dict[str, Any]
    kept: list[dict[str, Any]]
    """The newest items, kept verbatim after the compaction item."""
    compacted: int
    """Items the compaction item stands for."""
    tokens: int
    """Their tokens (as the model would have seen them)."""


Seal = Callable[[list[dict[str, str]]], str]
Unseal = Callable[[str], list[dict[str, str]]]
ToMessages = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def compact(items: Sequence[dict[str, Any]], keep_tokens: int, counter: TokenCounter, *, seal: Seal,
            unseal: Unseal, to_messages: ToMessages, item_id: str) -> Compaction | None:
    """Fold all but the newest turns of `items` (those within `keep_tokens`, at least one) into one
    compaction item; older compaction items fold in with their turns. None: nothing to fold."""
    sizes = [sum(counter.message_tokens(m) for m in to_messages([it])) for it in items]
    starts = [i for i, it in enumerate(items) if it["type"] == "message" and it.get("role") == "user"]
    cut = None
    for start in reversed(starts):
        if cut is not None and sum(sizes[start:]) > keep_tokens:
            break
        cut = start
    if not cut:
        return None
    earlier: list[dict[str, str]] = []
    for it in items[:cut]:
        if it["type"] == "compaction":
            earlier += open_compaction(it["encrypted_content"], unseal)[0]
        else:
            earlier += [{"role": m["role"], "content": m.get("content") or ""} for m in to_messages([it])]
    content = [{"role": "summary", "content": summary(earlier, counter)}, *earlier]
    item = {"type": "compaction", "id": item_id, "encrypted_content": seal(content), "created_by": "switchboard"}
    return Compaction(item, list(items[cut:]), cut, sum(sizes[:cut]))


def open_compaction(encrypted: str, unseal: Unseal) -> tuple[list[dict[str, str]], str]:
    """(the earlier turns, the summary) a compaction item holds; raises what `unseal` raises."""
    content = unseal(encrypted)
    if not content or content[0]["role"] != "summary":
        raise ValueError("not a compaction item")
    return content[1:], content[0]["content"]


class MemoryMetrics:
    """Recall and compaction: how often, and how many tokens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.recalls = Counter("switchboard_context_recall_total", "Requests whose context lost earlier turns, "
                               "by recall result (recalled|nothing_relevant).", ["result"], registry=registry)
        self.recalled_tokens = Counter("switchboard_context_recalled_tokens_total",
                                       "Prompt tokens of earlier turns re-injected by recall.", registry=registry)
        self.compactions = Counter("switchboard_context_compactions_total",
                                   "Compactions by trigger (endpoint|threshold).", ["trigger"], registry=registry)
        self.compacted_tokens = Counter("switchboard_context_compacted_tokens_total",
                                        "Tokens of earlier turns folded into compaction items.", registry=registry)
        for result in ("recalled", "nothing_relevant"):
            self.recalls.labels(result)
        for trigger in ("endpoint", "threshold"):
            self.compactions.labels(trigger)
