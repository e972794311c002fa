"""The context window on its own (data_plane/gateway/context.py, fit_window and TokenCounter),
with the whitespace counter (a token per word) so every count is worked out by hand.

    .venv/bin/python -m pytest tests/data_plane/test_context_window.py -q      # ~5 s (the last test loads the tokenizer)

With it a message costs words(content) + 1 (the role) + 5 (template), a prompt adds 3. The stepped
window (`step` > 0, the gateway's --context-trim-step) is checked over a seeded 40-turn chat: its
cut stays put for runs of turns (the prefix cache's hits) where the exact window's moves every turn.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from itertools import pairwise

import pytest

from data_plane.common.errors import ContextLengthExceeded
from data_plane.gateway.context import (
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_PRIMER_TOKENS,
    TEMPLATE_SLACK_TOKENS,
    TokenCounter,
    Window,
    fit_window,
    prompt_room,
    trim_step,
)
from data_plane.gateway.memory import RECALL_BUDGET_TOKENS, fit_with_recall


def msg(role: str, words: int, tag: str = "w") -> dict[str, str]:
    return {"role": role, "content": " ".join(f"{tag}{i}" for i in range(words))}


def cost(words: int) -> int:
    return words + 1 + MESSAGE_OVERHEAD_TOKENS


SYSTEM = msg("system", 4, "s")
TURNS = [msg("user", 10, "a"), msg("assistant", 10, "b"), msg("user", 10, "c"), msg("assistant", 10, "d"),
         msg("user", 10, "e")]
FULL = cost(4) + 5 * cost(10) + REPLY_PRIMER_TOKENS  # 10 + 80 + 3 = 93


def test_a_conversation_that_fits_is_kept_whole_with_its_exact_count() -> None:
    counter = TokenCounter.whitespace()
    window = fit_window([SYSTEM, *TURNS], counter, budget=FULL)
    assert window.messages == [SYSTEM, *TURNS] and window.prompt_tokens == FULL == 93 and window.dropped == 0
    assert counter.prompt_tokens([SYSTEM, *TURNS]) == FULL


def test_the_oldest_turns_go_first_and_the_system_message_stays() -> None:
    window = fit_window([SYSTEM, *TURNS], TokenCounter.whitespace(), budget=FULL - 1)
    # dropping the first user turn alone would leave an assistant turn first: it goes too
    assert window.messages == [SYSTEM, *TURNS[2:]]
    assert window.dropped == 2 and window.prompt_tokens == FULL - 2 * cost(10)


def test_as_many_turns_as_needed_are_dropped_and_no_more() -> None:
    budget = cost(4) + 3 * cost(10) + REPLY_PRIMER_TOKENS  # room for exactly three turns
    window = fit_window([SYSTEM, *TURNS], TokenCounter.whitespace(), budget=budget)
    assert window.messages == [SYSTEM, *TURNS[2:]] and window.prompt_tokens == budget and window.dropped == 2


def test_without_a_system_message_the_window_never_starts_with_an_assistant_turn() -> None:
    budget = 4 * cost(10) + REPLY_PRIMER_TOKENS  # room for four: the first user turn goes, then its reply
    window = fit_window(TURNS, TokenCounter.whitespace(), budget=budget)
    assert window.messages == TURNS[2:] and window.messages[0]["role"] == "user" and window.dropped == 2


def test_the_newest_message_is_never_dropped_and_too_big_a_one_is_a_context_error() -> None:
    huge = msg("user", 200, "z")
    with pytest.raises(ContextLengthExceeded) as raised:
        fit_window([SYSTEM, *TURNS, huge], TokenCounter.whitespace(), budget=100)
    assert raised.value.status == 400 and raised.value.param == "messages"
    only_last = fit_window([*TURNS, msg("user", 10, "f")], TokenCounter.whitespace(), budget=cost(10) + 3)
    assert only_last.messages == [msg("user", 10, "f")] and only_last.dropped == 5


def test_system_messages_are_kept_even_when_only_they_and_the_last_fit() -> None:
    late_system = msg("system", 2, "t")
    messages = [SYSTEM, *TURNS[:4], late_system, TURNS[4]]
    budget = cost(4) + cost(2) + cost(10) + REPLY_PRIMER_TOKENS
    window = fit_window(messages, TokenCounter.whitespace(), budget=budget)
    assert window.messages == [SYSTEM, late_system, TURNS[4]] and window.prompt_tokens == budget


def test_counts_are_cached_per_text_so_a_replayed_session_encodes_only_new_messages() -> None:
    calls: list[str] = []

    def words(text: str) -> int:
        calls.append(text)
        return len(text.split())

    counter = TokenCounter(words, cache_size=100)
    fit_window([SYSTEM, *TURNS[:2]], counter, budget=1000)
    first = len(calls)
    fit_window([SYSTEM, *TURNS[:3]], counter, budget=1000)
    assert len(calls) == first + 1 and calls[-1] == TURNS[2]["content"]  # roles were cached already


def test_the_count_cache_is_bounded_and_evicts_the_least_recent() -> None:
    calls: list[str] = []

    def one(text: str) -> int:
        calls.append(text)
        return 1

    counter = TokenCounter(one, cache_size=2)
    for text in ("a", "b", "a", "c", "a", "b"):
        counter.count(text)
    assert calls == ["a", "b", "c", "b"]  # "a" stayed recent; "b" was the one evicted by "c"


TEXTS = ["hello world", "", "  leading and trailing  ", "Write a short story about a robot named Unit-7.",
         "naïve café, 東京, emoji 🚀 and a lone\ttab\nnewline", "<|im_start|>user\nhi<|im_end|>", "x" * 3000,
         "def f(x):\n    return x ** 2  # code", "The harbour town kept its lighthouse lit. " * 20]


def test_the_default_models_counter_counts_as_its_transformers_tokenizer_does() -> None:
    """The gateway reads the default model's tokenizer.json with `tokenizers` (no transformers import at
    start-up): every count equals AutoTokenizer's encode without special tokens, a text that spells a control
    token counted as its characters (the shard encodes it so: data_plane/shard/engines/chat_tokens.py)."""
    from transformers import AutoTokenizer

    from data_plane.model_store import resolve_model

    counter = TokenCounter.for_model(None)
    reference = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    got = [counter.count(t) for t in TEXTS]
    assert got == [len(reference.encode(t, add_special_tokens=False, split_special_tokens=True)) for t in TEXTS]
    assert got[0] == 2 and got[1] == 0 and got[5] == 17  # the chat markers spelled in a text: 7 tokens each


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "naïve café, 東京 🚀"}, {"role": "assistant", "content": "Sure.\n\nHere:"},
     {"role": "user", "content": "def f(x):\n    return x"}],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, {"role": "user", "content": "x " * 50},
     {"role": "assistant", "content": "y"}, {"role": "user", "content": "The harbour town kept its lighthouse lit."}],
]


def test_the_default_models_prompt_count_is_the_shards_so_nothing_is_set_aside() -> None:
    """The gateway solves the chat template's own numbers (tokens around a message, the reply's primer, the
    default system prompt SmolLM2 adds to a chat without one) from renderings of it, so its prompt count is
    the shard's `usage.prompt_tokens` (the template rendered and tokenized whole), and no slack is kept: an
    app that asks for max_tokens = context - prompt_tokens is served (it was refused by 32 tokens' slack,
    and a chat without a system message was counted 21 tokens short)."""
    from transformers import AutoTokenizer

    from data_plane.model_store import resolve_model

    counter = TokenCounter.for_model(None)
    reference = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    for chat in CHATS:
        rendered = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert counter.prompt_tokens(chat) == len(rendered), chat
    assert (counter.message_overhead, counter.primer, counter.implicit_system, counter.slack) == (4, 4, 21, 0)
    assert TokenCounter.whitespace().slack == TEMPLATE_SLACK_TOKENS  # no template to check against: the slack stays


def test_a_chat_that_fills_the_context_exactly_fits_and_one_token_more_is_refused() -> None:
    counter = TokenCounter.for_model(None)
    chat = CHATS[0]
    used = counter.prompt_tokens(chat)
    budget, _ = prompt_room(2048, 2048 - used, True, 0, "max_tokens", counter.slack)
    assert fit_window(chat, counter, budget).prompt_tokens == used == 31
    budget, _ = prompt_room(2048, 2048 - used + 1, True, 0, "max_tokens", counter.slack)
    with pytest.raises(ContextLengthExceeded):
        fit_window(chat, counter, budget)


# -- the stepped window over a long chat --------------------------------------------------------

BUDGET, STEP = 600, trim_step(800, 0.25)  # an 800-token context less max_tokens and slack; 200-token steps


def long_chat(turns: int = 40, seed: int = 3) -> list[list[dict[str, str]]]:
    """Each turn's prompt of one seeded chat: the system prompt, the history, the new user message
    (whose first word, "lighthouse", the first turn also has, so recall finds something)."""
    rng = random.Random(seed)
    history: list[dict[str, str]] = [SYSTEM]
    prompts = []
    for t in range(turns):
        user = msg("user", rng.randint(5, 30), f"u{t}x")
        user = {"role": "user", "content": "lighthouse " + user["content"]}
        prompts.append([*history, user])
        history += [user, msg("assistant", rng.randint(10, 60), f"a{t}x")]
    return prompts


MAX_TURN = (1 + 30 + 1 + MESSAGE_OVERHEAD_TOKENS) + (60 + 1 + MESSAGE_OVERHEAD_TOKENS)
"""The costliest user message and reply of `long_chat`."""
ORDER = {m["content"]: i for i, m in enumerate(long_chat()[-1])}


def start(window: Window) -> int:
    """Where the window's kept history starts: the chat-wide index of its first non-system message."""
    return ORDER[next(m for m in window.messages if m["role"] != "system")["content"]]


def moves(windows: Sequence[Window]) -> int:
    """How often the window's start changed between consecutive turns that dropped something."""
    trimmed = [start(w) for w in windows if w.dropped]
    return sum(1 for a, b in pairwise(trimmed) if a != b) + bool(trimmed)


def test_the_stepped_cut_stays_put_for_runs_of_turns_where_the_exact_one_moves_every_turn() -> None:
    counter = TokenCounter.whitespace()
    prompts = long_chat()
    stepped = [fit_window(p, counter, BUDGET, STEP) for p in prompts]
    exact = [fit_window(p, counter, BUDGET) for p in prompts]
    trimmed = sum(1 for w in stepped if w.dropped)
    assert trimmed >= 25, "the chat must outgrow the window early: make it longer"
    droppable_at_end = counter.prompt_tokens(prompts[-1][1:-1]) - REPLY_PRIMER_TOKENS
    assert moves(stepped) <= droppable_at_end // STEP + 1
    assert moves(exact) >= 0.8 * trimmed and moves(stepped) <= 0.4 * trimmed, (moves(exact), moves(stepped))
    for p, w, e in zip(prompts, stepped, exact):
        assert w.prompt_tokens <= BUDGET and w.prompt_tokens == counter.prompt_tokens(w.messages)
        assert w.messages[0] == SYSTEM and w.messages[-1] == p[-1]
        assert w.messages[1:] == p[len(p) - len(w.messages) + 1:]  # a suffix of the history: no gaps
        assert w.messages[1]["role"] == "user" and w.dropped == len(p) - len(w.messages)
        # it drops at most a step (and the turn that crosses it) more than just enough
        assert w.prompt_tokens > BUDGET - STEP - MAX_TURN if w.dropped else w == e


def test_cut_moved_says_whether_the_prompt_starts_as_the_previous_turns_did() -> None:
    counter = TokenCounter.whitespace()
    for step in (STEP, 0):
        windows = [fit_window(p, counter, BUDGET, step) for p in long_chat()]
        for before, now in pairwise(windows):
            if now.dropped:
                assert now.cut_moved == (not before.dropped or start(before) != start(now)), step
            else:
                assert not now.cut_moved
        assert sum(w.cut_moved for w in windows) == moves(windows)


def test_step_zero_is_the_exact_window_of_before() -> None:
    """Random conversations (late system messages, assistant-first ones, tool turns, any budget):
    step 0 gives what the sliding window gave before steps existed (`exact_window` below, its code)."""
    rng, counter = random.Random(11), TokenCounter.whitespace()
    for case in range(400):
        roles = [rng.choice(["user", "assistant", "user", "assistant", "system", "tool"])
                 for _ in range(rng.randint(1, 12))]
        messages = [msg(role, rng.randint(0, 20), f"m{case}x{i}x") for i, role in enumerate(roles)]
        budget = rng.randint(1, counter.prompt_tokens(messages) + 5)
        try:
            want: Window | str = exact_window(messages, counter, budget)
        except ContextLengthExceeded as exc:
            want = exc.message
        try:
            got: Window | str = fit_window(messages, counter, budget, step=0)
        except ContextLengthExceeded as exc:
            got = exc.message
        if isinstance(got, Window):
            got = Window(got.messages, got.prompt_tokens, got.dropped)  # cut_moved is new
        assert got == want, (messages, budget)


def test_a_smaller_max_tokens_does_not_move_the_cut_while_the_window_still_fits() -> None:
    counter = TokenCounter.whitespace()
    for p in long_chat():
        wide = fit_window(p, counter, BUDGET, STEP)
        for less in (10, 40, 120):
            narrow = fit_window(p, counter, BUDGET - less, STEP)
            if wide.prompt_tokens <= BUDGET - less:
                assert narrow.messages == wide.messages
            else:  # it moves by a step, not by just enough
                assert narrow.dropped > wide.dropped


def test_recall_keeps_the_stepped_cut_and_goes_right_before_the_new_message() -> None:
    counter = TokenCounter.whitespace()
    windows = []
    for p in long_chat():
        window, found = fit_with_recall(p, [], counter, BUDGET, STEP)
        plain = fit_window(p, counter, BUDGET - min(RECALL_BUDGET_TOKENS, BUDGET // 4), STEP)
        if found is None or found.message is None:
            assert window.messages in (plain.messages, fit_window(p, counter, BUDGET, STEP).messages)
            windows.append(window)
            continue
        assert window.messages[-2] == found.message and window.messages[-1] == p[-1]
        assert window.messages[:-2] + window.messages[-1:] == plain.messages
        assert window.prompt_tokens <= BUDGET and window.cut_moved == plain.cut_moved
        windows.append(plain)
    trimmed = sum(1 for w in windows if w.dropped)
    assert trimmed >= 25 and moves(windows) <= 0.4 * trimmed


def exact_window(messages: Sequence[dict[str, str]], counter: TokenCounter, budget: int) -> Window:
    """fit_window as it was before steps (commit ee38941): drop just enough, oldest first (its
    opening guard as it is now, see below)."""
    sizes = [counter.message_tokens(m) for m in messages]
    total = sum(sizes) + REPLY_PRIMER_TOKENS
    keep = [True] * len(messages)
    dropped = 0
    last = len(messages) - 1
    for i, m in enumerate(messages):
        if total <= budget:
            break
        if m["role"] == "system" or i == last:
            continue
        keep[i] = False
        total -= sizes[i]
        dropped += 1
    if total > budget:
        raise ContextLengthExceeded(
            f"the conversation needs {total} prompt tokens even after dropping older turns, "
            f"but only {budget} fit with this max_tokens; shorten the message or lower max_tokens",
            param="messages",
        )
    kept = [m for m, k in zip(messages, keep) if k]
    # Changed since: the opening guard applies only to a cut window, after all its system messages
    # (an app's assistant greeting stays while the conversation fits).
    lead = next((j for j, m in enumerate(kept) if m["role"] != "system"), len(kept))
    while dropped and lead < len(kept) - 1 and kept[lead]["role"] == "assistant":
        total -= counter.message_tokens(kept[lead])
        kept.pop(lead)
        dropped += 1
    return Window(kept, total, dropped)


def test_a_step_past_half_the_budget_still_keeps_recent_turns() -> None:
    """A large max_tokens (or a context shrunk under degradation) leaves a budget smaller than the
    step: the step is capped at half the budget, so a window one token over drops old turns, not
    the whole history."""
    counter = TokenCounter.whitespace()
    p = [SYSTEM, *(msg("user" if i % 2 == 0 else "assistant", 10, f"t{i}") for i in range(21))]
    budget = counter.prompt_tokens(p) - 1
    window = fit_window(p, counter, budget, step=10 * budget)
    assert window.prompt_tokens <= budget and window.messages[0] == SYSTEM and window.messages[-1] == p[-1]
    # at least the budget less the (capped) step and one turn (a user message and its reply)
    assert window.prompt_tokens >= budget - budget // 2 - 2 * cost(10) and len(window.messages) >= 9, window


def test_recall_falls_back_to_the_plain_window_when_its_reserve_does_not_fit() -> None:
    """A conversation whose system prompt and new message fit the budget but not the budget less
    recall's reserve is served by the plain window (before: a 400 for a request that fits)."""
    counter = TokenCounter.whitespace()
    big_new = msg("user", 60, "n")
    p = [SYSTEM, msg("user", 10, "a"), msg("assistant", 10, "b"), big_new]
    budget = cost(4) + cost(60) + REPLY_PRIMER_TOKENS + 5  # only the system prompt and the new message fit
    window, found = fit_with_recall(p, [], counter, budget)
    assert found is None and window.messages == [SYSTEM, big_new]


def test_a_conversation_that_fits_keeps_its_assistant_greeting_and_a_cut_one_never_opens_with_a_reply() -> None:
    """An app's greeting ("How can I help?") before the first user message is part of the
    conversation while it fits; once old turns are cut, the window does not open with a reply whose
    question is gone, however many system messages lead it."""
    counter = TokenCounter.whitespace()
    greeting = msg("assistant", 3, "g")
    p = [SYSTEM, greeting, *TURNS]
    whole = fit_window(p, counter, budget=10_000)
    assert whole.messages == p and whole.dropped == 0 and not whole.cut_moved
    two_systems = [SYSTEM, msg("system", 3, "x"), *TURNS]
    budget = counter.prompt_tokens(two_systems) - 1  # one token over: the first user turn goes, then its reply
    cut = fit_window(two_systems, counter, budget=budget)
    assert [m["role"] for m in cut.messages[:3]] == ["system", "system", "user"], cut.messages


def test_the_counts_cache_holds_a_bounded_number_of_bytes_whatever_the_texts() -> None:
    """The cache of counts was bounded by entries only (50,000), and keyed by the texts themselves: one free key
    sending a distinct ~1 MB message a second (each a 400, it cannot fit) grew the gateway by over 1 MB a request.
    It now holds at most CACHE_BYTES of texts (the least recently counted go first), and still caches."""
    import sys
    import tracemalloc

    from data_plane.gateway.context import CACHE_BYTES

    counter = TokenCounter.whitespace()
    tracemalloc.start()
    try:
        for i in range(120):  # 120 MB of distinct texts, each dropped by its sender
            assert counter.count(f"{i} " + "x" * 1_000_000) == 2
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < CACHE_BYTES + (8 << 20), held
    text = "a b c"
    assert counter.count(text) == 3 and text in counter._cache  # short texts are still kept
    assert sys.getsizeof(text) < CACHE_BYTES


def test_a_text_longer_than_any_window_is_bounded_not_encoded() -> None:
    """A text whose bytes over the longest token's exceed the model's context holds more tokens than any window:
    that lower bound is its count, and the tokenizer never sees it (a ~1 MB message took 0.6-1.2 s to encode)."""
    seen: list[int] = []

    def encode(text: str) -> int:
        seen.append(len(text))
        return len(text)

    counter = TokenCounter(encode, ceiling=100, token_bytes=4)
    assert counter.count("x" * 1000) == 250 and seen == []  # 1000 bytes hold at least 250 tokens > 100
    assert counter.count("é" * 300) == 150 and seen == []  # bytes, not characters
    assert counter.count("x" * 400) == 400 and seen == [400]  # 100 tokens at least: it may fit, so it is encoded
    real = TokenCounter.for_model(None)
    assert real.count("é" * 500_000) == 1_000_000 // 81 > 8192  # SmolLM2: 8,192 positions, 81 bytes a token at most


def test_long_texts_are_counted_off_the_event_loop() -> None:
    """`warm` counts a long text in a worker thread, so the event loop keeps serving other requests meanwhile
    (the tokenizer's encode_batch lets go of the GIL); the synchronous count after it is a cache hit."""
    calls: list[str] = []

    def slow(text: str) -> int:
        calls.append(text[:1])
        time.sleep(0.6)  # a tokenizer busy outside the GIL
        return len(text.split())

    counter = TokenCounter(slow)
    long_text = "word " * 5_000

    async def scenario() -> tuple[int, float]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = time.monotonic()
        await counter.warm([{"role": "user", "content": long_text}, {"role": "user", "content": "short"}])
        took = time.monotonic() - started
        done.set()
        await task
        return ticks, took

    ticks, took = asyncio.run(scenario())
    assert took >= 0.6 and ticks >= 10  # the loop ran while the text was counted (blocked: 0 or 1 tick)
    assert calls == ["w"]  # the short text is left to the synchronous count
    assert counter.count(long_text) == 5_000 and calls == ["w"]  # a cache hit
