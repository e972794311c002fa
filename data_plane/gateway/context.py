"""Fitting a conversation into the context window, counted with the model's own tokenizer.

    counter = TokenCounter.for_model(None)            # the default model's tokenizer
    window = fit_window(messages, counter, budget=2048 - max_tokens, step=trim_step(2048, 0.25))
    window.messages, window.prompt_tokens, window.dropped, window.cut_moved

The sliding window keeps every system message and the newest turns, dropping the oldest
non-system messages first; the newest message is never dropped (if it alone does not fit,
that is the caller's 400). It drops them in steps fixed by the conversation (`step`, the gateway's
`--context-trim-step` share of the context): the cut stays at the same message for ~`step` tokens
of new conversation, so those turns keep hitting the shard's prefix cache, instead of moving every
turn (docs/BENCHMARKS.md, "One long chat through the full stack"). The chat template renders the
same tokens before the cut whatever it is (its default system prompt goes in only when the prompt
has none, and then on every turn alike). Counts come from the tokenizer on each message's rendered
chat-template form, cached per message, so replaying a long session costs one tokenizer call per
*new* message, not per request.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_plane.common.errors import ContextLengthExceeded

MESSAGE_OVERHEAD_TOKENS = 5
"""Chat-template tokens around each message (`<|im_start|>role\\n ... <|im_end|>\\n`)."""
REPLY_PRIMER_TOKENS = 3
"""`<|im_start|>assistant\\n` that starts the reply."""


CACHE_BYTES = 64 << 20
"""What the counts' cache may hold of the texts it is keyed by (`sys.getsizeof`), beside its entry bound. With
the entry bound alone (50,000) one free key sending a distinct ~1 MB message a second (a 400: it does not fit)
grew the gateway by ~1.4 MB a request, towards ~50 GB; the least recently counted texts now go first."""


OFF_LOOP_CHARS = 16_384
"""Texts at least this long are counted by `TokenCounter.warm` in a worker thread (the tokenizer lets go of the
GIL there): ~1 MB took 0.6-1.2 s to count on the event loop, and a free key sending such messages (each a 400,
under its RPM) held every tenant's requests behind it (enterprise p50 0.11 -> 3.08 s)."""


class TokenCounter:
    def __init__(self, encode: Callable[[str], int], cache_size: int = 50_000, *, cache_bytes: int = CACHE_BYTES,
                 ceiling: int = 0, token_bytes: int = 0) -> None:
        self._encode = encode
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cached_bytes = 0
        self.message_overhead, self.primer, self.implicit_system = MESSAGE_OVERHEAD_TOKENS, REPLY_PRIMER_TOKENS, 0
        """The chat template in tokens: around each message, the reply's primer, the default system prompt it adds
        to a chat without one (generic constants until `for_model` solves the model's own: `template_frame`)."""
        self.slack = TEMPLATE_SLACK_TOKENS
        """Tokens a prompt's budget sets aside for template tokens the count cannot see (0 once solved)."""
        self.decode: Callable[[list[int]], str] | None = None
        """Token ids as the text they spell (the model's tokenizer; None for the synthetic engine's words): what
        the input filters read of a legacy completion's token-id prompt."""
        self._ceiling, self._token_bytes = ceiling, token_bytes
        """A text whose UTF-8 bytes over the longest token's (`token_bytes`) exceed `ceiling` (the model's own
        context) holds more tokens than any window of the model: that lower bound is its count, unencoded (no
        window can keep it, so its exact size decides nothing). 0: every text is encoded."""

    @classmethod
    def for_model(cls, model: str | None) -> TokenCounter:
        from data_plane.model_store import resolve_model

        folder = resolve_model(model)
        config = _read_json(folder / "tokenizer_config.json")
        tok = _model_tokenizer(folder, config)
        counter = cls(tok.count, ceiling=_model_context(folder), token_bytes=tok.token_bytes)
        counter.decode = tok.decode
        frame = template_frame(_chat_template(folder, config), config, counter.count, tok.rendered)
        if frame is not None:  # the template's own numbers, checked: nothing set aside
            counter.message_overhead, counter.primer, counter.implicit_system = frame
            counter.slack = 0
        return counter

    @classmethod
    def whitespace(cls) -> TokenCounter:
        """For the synthetic engine, whose tokens are words."""
        return cls(lambda text: len(text.split()))

    def count(self, text: str) -> int:
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        n = self._bound(text)
        return self._remember(text, self._encode(text) if n is None else n)

    async def warm(self, messages: Sequence[dict[str, str]]) -> None:
        """Count the long texts of `messages` not counted yet in a worker thread, so the synchronous counts
        after it (the budget, the window) find them cached and the event loop never waits on a tokenizer."""
        for m in messages:
            text = m["content"]
            if len(text) >= OFF_LOOP_CHARS and text not in self._cache:
                n = self._bound(text)
                self._remember(text, await asyncio.to_thread(self._encode, text) if n is None else n)

    def _bound(self, text: str) -> int | None:
        """More tokens than the model's context, without encoding (`ceiling`); None: count it."""
        if not self._ceiling or len(text) * 4 <= self._ceiling * self._token_bytes:
            return None
        least = len(text.encode("utf-8", "surrogatepass")) // self._token_bytes
        return least if least > self._ceiling else None

    def _remember(self, text: str, n: int) -> int:
        size = sys.getsizeof(text)
        if size > self._cache_bytes // 8:  # counted again if it comes back: kept, it would push out 1/8 of the cache
            return n
        self._cache[text] = n
        self._cached_bytes += size
        while len(self._cache) > self._cache_size or self._cached_bytes > self._cache_bytes:
            self._cached_bytes -= sys.getsizeof(self._cache.popitem(last=False)[0])
        return n

    def message_tokens(self, message: dict[str, str]) -> int:
        return self.count(message["content"]) + self.count(message["role"]) + self.message_overhead

    def frame_tokens(self, messages: Sequence[dict[str, str]]) -> int:
        """The prompt's tokens beyond its messages': the reply's primer, and the template's default system
        prompt when the chat has no system message (system messages are never dropped, so a window's frame
        is its conversation's)."""
        implicit = 0 if any(m["role"] == "system" for m in messages) else self.implicit_system
        return self.primer + implicit

    def prompt_tokens(self, messages: Sequence[dict[str, str]]) -> int:
        return sum(self.message_tokens(m) for m in messages) + self.frame_tokens(messages)


def template_frame(template: str | None, config: dict[str, Any], count: Callable[[str], int],
                   raw: Callable[[str], int]) -> tuple[int, int, int] | None:
    """The model's chat template in tokens: (each message's tokens beyond its role and content, the reply's
    primer, the default system prompt it adds to a chat with none), solved from renderings of three probe
    chats and checked on two more; `raw` counts a rendered prompt (its control tokens as control tokens).
    SmolLM2's: (4, 4, 21). None when there is no template, it does not render here, or a check fails (the
    counter then keeps its generic constants and the gateway its slack). `config`: tokenizer_config.json."""
    if template is None:
        return None

    def special(name: str) -> str:
        value = config.get(name)
        return str(value.get("content", "")) if isinstance(value, dict) else str(value or "")

    s, u, a = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
               {"role": "assistant", "content": "Hi! How can I help?"})
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        compiled = env.from_string(template)

        def rendered(*messages: dict[str, str]) -> int:
            return raw(compiled.render(messages=list(messages), add_generation_prompt=True,
                                       bos_token=special("bos_token"), eos_token=special("eos_token")))

        def own(*messages: dict[str, str]) -> int:
            return sum(count(m["content"]) + count(m["role"]) for m in messages)

        overhead = rendered(s, u) - rendered(s) - own(u)
        primer = rendered(s) - own(s) - overhead
        implicit = rendered(u) - own(u) - overhead - primer
        checks = ((rendered(s, u, a, u), own(s, u, a, u) + 4 * overhead + primer),
                  (rendered(u, a, u), own(u, a, u) + 3 * overhead + primer + implicit))
    except (ImportError, TemplateError, TypeError, ValueError):
        return None
    if min(overhead, primer, implicit) < 0 or any(got != want for got, want in checks):
        return None
    return overhead, primer, implicit


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when it is absent or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's (`config`), its default if named."""
    source = folder / "chat_template.jinja"
    template = source.read_text(encoding="utf-8") if source.exists() else config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


FAST_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_config.json classes that are the `tokenizers` library's tokenizer.json and nothing more
(the shard's model_files.py loads the same set directly)."""


@dataclass(frozen=True)
class _ModelTokenizer:
    count: Callable[[str], int]
    """Tokens in a message's text, no special tokens added, a text spelling "<|im_end|>" as its characters (as
    the shard encodes a message)."""
    rendered: Callable[[str], int]
    """Tokens in a rendered prompt, its control tokens as control tokens (`template_frame`'s check, at start-up)."""
    decode: Callable[[list[int]], str]
    token_bytes: int
    """`_longest_token_bytes`."""


def _model_tokenizer(folder: Path, config: dict[str, Any]) -> _ModelTokenizer:
    """The model's tokenizer (`config`: its tokenizer_config.json). A plain fast tokenizer is read straight from
    tokenizer.json with `tokenizers`: importing transformers made a gateway's start-up seconds slower (~25 s on a
    loaded 2-core host, against ~1 s), for the same counts (tests/data_plane/test_context_window.py). Any other
    tokenizer: transformers' AutoTokenizer."""
    if config.get("tokenizer_class") in FAST_TOKENIZER_CLASSES and (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
        fast.encode_special_tokens = True

        def rendered(text: str) -> int:  # start-up only, before the counter is shared with any thread
            fast.encode_special_tokens = False
            try:
                return len(fast.encode(text, add_special_tokens=False).ids)
            finally:
                fast.encode_special_tokens = True

        # encode_batch: the tokenizer lets go of the GIL there (encode holds it), so `warm`'s thread runs
        # beside the event loop
        return _ModelTokenizer(lambda text: len(fast.encode_batch([text], add_special_tokens=False)[0].ids),
                               rendered, lambda ids: fast.decode(ids, skip_special_tokens=False),
                               _longest_token_bytes(fast.get_vocab(), type(fast.decoder).__name__ == "ByteLevel"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return _ModelTokenizer(lambda text: len(tok.encode(text, add_special_tokens=False, split_special_tokens=True)),
                           lambda text: len(tok.encode(text, add_special_tokens=False)),
                           lambda ids: str(tok.decode(ids, skip_special_tokens=False)),
                           _longest_token_bytes(tok.get_vocab()))


def _longest_token_bytes(vocab: dict[str, int], byte_level: bool = False) -> int:
    """An upper bound on the input bytes one token covers: a byte-level BPE's vocabulary string spells each
    input byte as one character (SmolLM2's longest: 81); any other, its string's UTF-8 length (a SentencePiece
    string is the text itself, "▁" for a space: 3 bytes for 1, an over-estimate, which only weakens the bound)."""
    size: Callable[[str], int] = len if byte_level else (lambda token: len(token.encode("utf-8", "surrogatepass")))
    return max((size(token) for token in vocab), default=0) or 1


def _model_context(folder: Path) -> int:
    """The model's own context (config.json's max_position_embeddings), 0 when unknown."""
    value = _read_json(folder / "config.json").get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else 0


@dataclass(frozen=True)
class Window:
    messages: list[dict[str, str]]
    prompt_tokens: int
    dropped: int
    cut_moved: bool = False
    """Older messages were dropped and the first kept one is not the one the conversation's previous
    turn (the messages before its last assistant reply) gets under the same budget and step: the
    prompt's start changed, so the shard's prefix cache misses past the system prompt."""


DEFAULT_TRIM_STEP_SHARE = 0.25
"""The gateway's default `--context-trim-step`: the window drops old turns a quarter of the context
at a time (the prompt keeps at least its budget less a quarter of the context and one turn)."""


def prompt_budget(context: int, reserve: int, slack: int, tools_tokens: int, limit_param: str) -> int:
    """The tokens left for the prompt in a `context`-token window once the reply's `reserve`, the
    template's `slack` and the tools' own prompt are set aside; a 400 naming the field to change when
    none are: the tools when without them the prompt would have had room (a request with no output
    limit of its own is not told to lower one), else the output limit as the body spelt it."""
    budget = context - reserve - slack - tools_tokens
    if budget > 0:
        return budget
    if budget + tools_tokens > 0:
        raise ContextLengthExceeded(
            f"the tool definitions take {tools_tokens} tokens, which with {reserve} kept for the reply leave "
            f"no room for the prompt in a {context}-token context; send fewer or shorter tools",
            param="tools")
    raise ContextLengthExceeded(f"{limit_param} {reserve} leaves no room for the prompt in a {context}-token "
                                f"context", param=limit_param)


DEFAULT_REPLY_RESERVE = 256
"""Reply tokens reserved when a request sets no max_tokens."""
TEMPLATE_SLACK_TOKENS = 32
"""Headroom for chat-template tokens the per-message count cannot see (e.g. a default system
prompt the template inserts), so the shard never refuses what the gateway admitted."""


def prompt_room(context: int, max_tokens: int, output_limit: bool, tools_tokens: int,
                limit_param: str, slack: int = TEMPLATE_SLACK_TOKENS) -> tuple[int, int]:
    """(budget, most): the prompt's tokens in a `context`-token window beside the reply's reserve (its
    `max_tokens` when the request set an `output_limit`, else a modest reply: the reply then gets the room
    the prompt leaves, as vLLM serves it), and the most it may take (beside a one-token reply when the request
    set no limit; the budget otherwise). A 400 as `prompt_budget`'s when there is no room."""
    reserve = max_tokens if output_limit else min(max_tokens, DEFAULT_REPLY_RESERVE, context // 2)
    budget = prompt_budget(context, reserve, slack, tools_tokens, limit_param)
    return budget, budget if output_limit else budget + reserve - 1


def trim_step(context: int, share: float) -> int:
    """The step in tokens for a `context`-token window (0: the exact sliding window)."""
    return max(0, int(context * share))


def fit_window(messages: Sequence[dict[str, str]], counter: TokenCounter, budget: int, step: int = 0) -> Window:
    """Keep system messages and the newest turns so the prompt fits in `budget` tokens.

    With `step` > 0 the oldest non-system messages go in steps fixed by the conversation itself:
    cut candidate m is the first turn boundary (a kept part that does not start with an assistant
    reply) at or past m x `step` tokens of droppable messages counted from the conversation's start,
    and the smallest m that fits wins. The cut then stays at the same message while about `step`
    tokens of new conversation arrive, so those turns' prompts all start with the same tokens (the
    shard's prefix cache serves them), and needs no state: the same messages give the same window on
    any gateway. `step` must not depend on the request's max_tokens (a step that varies moves the
    cut); 0 drops just enough, the cut moving nearly every turn."""
    sizes = [counter.message_tokens(m) for m in messages]
    frame = counter.frame_tokens(messages)
    budget -= frame - REPLY_PRIMER_TOKENS  # the template's default system prompt: never dropped, like a system message
    # A step past half the budget (a large max_tokens, a shrunk context under degradation) would make
    # "drop every old turn" the only candidate: half the budget at most.
    step = min(step, max(1, budget // 2)) if step > 0 else 0
    gone = _dropped(messages, sizes, budget, step)
    if gone is None:
        left = sum(sizes) + frame - sum(sizes[i] for i in _droppable(messages))
        raise ContextLengthExceeded(
            f"the conversation needs {left} prompt tokens even after dropping older turns, "
            f"but only {budget + frame - REPLY_PRIMER_TOKENS} fit with this max_tokens; shorten the message or "
            f"lower max_tokens",
            param="messages",
        )
    kept = [m for i, m in enumerate(messages) if i not in gone]
    total = sum(sizes) + frame - sum(sizes[i] for i in gone)
    moved = bool(gone) and _dropped_before(messages, sizes, budget, step) != gone
    return Window(kept, total, len(gone), moved)


def _droppable(messages: Sequence[dict[str, str]]) -> list[int]:
    """Indexes of the messages the window may drop, oldest first: not a system one, not the newest."""
    last = len(messages) - 1
    return [i for i, m in enumerate(messages) if m["role"] != "system" and i != last]


def _dropped(messages: Sequence[dict[str, str]], sizes: Sequence[int], budget: int, step: int) -> set[int] | None:
    """Indexes of the messages the window drops; None when dropping all it may is not enough."""
    droppable = _droppable(messages)
    cut = _cut(messages, droppable, sizes, sum(sizes) + REPLY_PRIMER_TOKENS - budget, step)
    if cut is None:
        return None
    gone = set(droppable[:cut])
    if not gone:  # a conversation that fits goes as the app sent it (an assistant greeting first included)
        return gone
    kept = [i for i in range(len(messages)) if i not in gone]
    # A cut window must not open with an assistant turn (after the system messages): its question is gone.
    lead = next((j for j, i in enumerate(kept) if messages[i]["role"] != "system"), len(kept))
    while lead < len(kept) - 1 and messages[kept[lead]]["role"] == "assistant":
        gone.add(kept.pop(lead))
    return gone


def _cut(messages: Sequence[dict[str, str]], droppable: Sequence[int], sizes: Sequence[int], need: int,
         step: int) -> int | None:
    """How many of the droppable messages (oldest first) to drop to save `need` tokens; None when all are not enough."""
    if need <= 0:
        return 0
    gone, pending = 0, False
    for k, i in enumerate(droppable, start=1):
        before, gone = gone, gone + sizes[i]
        if step <= 0:
            if gone >= need:
                return k
            continue
        pending = pending or gone // step > before // step  # a multiple of the step reached
        if k < len(droppable) and (not pending or messages[droppable[k]]["role"] == "assistant"):
            continue  # not a candidate: before the next multiple, or the kept part would open with a reply
        pending = False
        if gone >= need:
            return k
    return None


def _dropped_before(messages: Sequence[dict[str, str]], sizes: Sequence[int], budget: int,
                    step: int) -> set[int] | None:
    """What the window of the conversation's previous turn (the messages before its last assistant
    reply) drops under the same budget and step; None when there is no previous turn or it did not fit."""
    last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    if last_reply == 0:
        return None
    return _dropped(messages[:last_reply], sizes[:last_reply], budget, step)
