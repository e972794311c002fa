"""Fitting a conversation into the context window, counted with the model's own tokenizer.

    counter = TokenCounter.for_model(None)            # the default model's tokenizer
    window = fit_window(messages, counter, budget=2048 - max_tokens)
    window.messages, window.prompt_tokens, window.dropped

The sliding window keeps every system message and the newest turns, dropping the oldest
non-system messages first; the newest message is never dropped (if it alone does not fit,
that is the caller's 400). Counts come from the tokenizer on each message's rendered
chat-template form, cached per message, so replaying a long session costs one tokenizer
call per *new* message, not per request.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from data_plane.common.errors import ContextLengthExceeded

MESSAGE_OVERHEAD_TOKENS = 5
"""Chat-template tokens around each message (`<|im_start|>role\\n ... <|im_end|>\\n`)."""
REPLY_PRIMER_TOKENS = 3
"""`<|im_start|>assistant\\n` that starts the reply."""


class TokenCounter:
    def __init__(self, encode: Callable[[str], int], cache_size: int = 50_000) -> None:
        self._encode = encode
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def for_model(cls, model: str | None) -> TokenCounter:
        from data_plane.model_store import resolve_model

        return cls(_model_encoder(resolve_model(model)))

    @classmethod
    def whitespace(cls) -> TokenCounter:
        """For the synthetic engine, whose tokens are words."""
        return cls(lambda text: len(text.split()))

    def count(self, text: str) -> int:
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        n = self._encode(text)
        self._cache[text] = n
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return n

    def message_tokens(self, message: dict[str, str]) -> int:
        return self.count(message["content"]) + self.count(message["role"]) + MESSAGE_OVERHEAD_TOKENS

    def prompt_tokens(self, messages: Sequence[dict[str, str]]) -> int:
        return sum(self.message_tokens(m) for m in messages) + REPLY_PRIMER_TOKENS


FAST_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_config.json classes that are the `tokenizers` library's tokenizer.json and nothing more
(the shard's model_files.py loads the same set directly)."""


def _model_encoder(folder: Path) -> Callable[[str], int]:
    """Tokens in a text, without special tokens added, as the model's tokenizer counts them. A plain
    fast tokenizer is read straight from tokenizer.json with `tokenizers`: importing transformers
    made a gateway's start-up seconds slower (~25 s on a loaded 2-core host, against ~1 s), for the
    same counts (tests/data_plane/test_context_window.py). Any other tokenizer: transformers' AutoTokenizer."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") in FAST_TOKENIZER_CLASSES and (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return lambda text: len(fast.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return lambda text: len(tok.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Window:
    messages: list[dict[str, str]]
    prompt_tokens: int
    dropped: int


def fit_window(messages: Sequence[dict[str, str]], counter: TokenCounter, budget: int) -> Window:
    """Keep system messages and the newest turns so the prompt fits in `budget` tokens."""
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
    # A window must not start with an assistant turn right after the system prompt.
    while len(kept) > 1 and kept[0]["role"] == "assistant" or (
        len(kept) > 2 and kept[0]["role"] == "system" and kept[1]["role"] == "assistant"
    ):
        idx = 0 if kept[0]["role"] == "assistant" else 1
        total -= counter.message_tokens(kept[idx])
        kept.pop(idx)
        dropped += 1
    return Window(kept, total, dropped)
