"""The context window on its own (data_plane/gateway/context.py, fit_window and TokenCounter),
with the whitespace counter (a token per word) so every count is worked out by hand.

    .venv/bin/python -m pytest tests/data_plane/test_context_window.py -q      # ~5 s (the last test loads the tokenizer)

With it a message costs words(content) + 1 (the role) + 5 (template), a prompt adds 3.
"""

from __future__ import annotations

import pytest

from data_plane.common.errors import ContextLengthExceeded
from data_plane.gateway.context import MESSAGE_OVERHEAD_TOKENS, REPLY_PRIMER_TOKENS, TokenCounter, fit_window


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
    counter = TokenCounter(lambda text: calls.append(text) or len(text.split()), cache_size=100)
    fit_window([SYSTEM, *TURNS[:2]], counter, budget=1000)
    first = len(calls)
    fit_window([SYSTEM, *TURNS[:3]], counter, budget=1000)
    assert len(calls) == first + 1 and calls[-1] == TURNS[2]["content"]  # roles were cached already


def test_the_count_cache_is_bounded_and_evicts_the_least_recent() -> None:
    calls: list[str] = []
    counter = TokenCounter(lambda text: calls.append(text) or 1, cache_size=2)
    for text in ("a", "b", "a", "c", "a", "b"):
        counter.count(text)
    assert calls == ["a", "b", "c", "b"]  # "a" stayed recent; "b" was the one evicted by "c"


TEXTS = ["hello world", "", "  leading and trailing  ", "Write a short story about a robot named Unit-7.",
         "naïve café, 東京, emoji 🚀 and a lone\ttab\nnewline", "<|im_start|>user\nhi<|im_end|>", "x" * 3000,
         "def f(x):\n    return x ** 2  # code", "The harbour town kept its lighthouse lit. " * 20]


def test_the_default_models_counter_counts_as_its_transformers_tokenizer_does() -> None:
    """The gateway reads the default model's tokenizer.json with `tokenizers` (no transformers import at
    start-up): every count equals AutoTokenizer's encode without special tokens."""
    from transformers import AutoTokenizer

    from data_plane.model_store import resolve_model

    counter = TokenCounter.for_model(None)
    reference = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    got = [counter.count(t) for t in TEXTS]
    assert got == [len(reference.encode(t, add_special_tokens=False)) for t in TEXTS]
    assert got[0] == 2 and got[1] == 0 and got[5] == 5  # the chat markers are one token each
