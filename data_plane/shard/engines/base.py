"""The engine contract a shard serves, and the per-request text plumbing every engine shares.

    engine = build_engine(settings)            # see ENGINES
    ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    req = GenerationRequest("req-1", ids, SamplingParams(max_tokens=32, temperature=0.0))
    async for out in engine.generate(req):     # text deltas, then one output with finish_reason
        print(out.text, end="")

`generate` validates and enqueues at call time, before any compute (context length,
parameters, queue bound), raising `data_plane.common.errors` types; the shard answers those
before the first SSE byte. Cancelling the iterator (a client that went
away) aborts the request at the engine's next step and frees its slot.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from data_plane.common.errors import ContextLengthExceeded, InvalidRequest
from data_plane.shard.engines.grammar import CompiledGrammar, GrammarSpec

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    max_tokens: int | None = None
    """Output token cap; None means up to the context limit."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; never included in the output."""
    seed: int | None = None
    """Seeds this request's draws, keyed by output position (torch_sampling.Draws): same seed, same prompt ->
    same text, with or without speculation, and a resumed stream continues it. Exact where the logits are
    the same bits: float32 up to GEMM row-count rounding (~1e-5, rarely a token); bf16/fp16 when batched alike."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top token's probability (after temperature), 0..1."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's), -2..2."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output (OpenAI's), -2..2."""
    repetition_penalty: float = 1.0
    """vLLM's/HF's: logits of prompt and output tokens divided (positive) or multiplied (negative) by it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to the logits, -100..100 each."""
    min_tokens: int = 0
    """EOS is banned until this many tokens are out (vLLM's)."""
    ignore_eos: bool = False
    """EOS never ends the output (vLLM's; benchmarks fix output lengths with it)."""
    logprobs: bool = False
    """Report each output token's log-probability (GenerationOutput.logprobs)."""
    top_logprobs: int = 0
    """... and this many most likely alternatives, 0..20."""
    prompt_logprobs: int | None = None
    """Report each prompt token's log-probability and this many most likely alternatives (0..5; None: none):
    GenerationOutput.prompt_logprobs (vLLM's `prompt_logprobs`; the legacy Completions API's echo + logprobs).
    Such a request bypasses the prefix cache: a cached prefix has no logits, so its whole prompt is computed."""
    grammar: GrammarSpec | None = None
    """Constrained decoding: the output follows this grammar (data_plane/shard/engines/grammar.py)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Anything beyond temperature/top_k/top_p/min_p: the engine builds a per-request processor
        (data_plane/shard/engines/logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.ignore_eos or self.logprobs
                    or self.grammar is not None)


@dataclass(frozen=True)
class KVSessionRef:
    """Where a session's KV blocks live on the cache nodes: placed by `session_id` like its
    transcript, on `replicas` nodes (its tier's), expiring with it after `ttl_s` (None: the node's default)."""

    session_id: str
    replicas: int = 1
    ttl_s: float | None = None
    origin: SpanContext | None = None
    """The turn's span (shard.generate): the offload of its blocks, background work in a trace of its own,
    links to it."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower runs first (the gateway maps tiers: enterprise 0, plus 1, free 2)."""
    deadline: float | None = None
    """Unix seconds; a request still waiting then is abandoned."""
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Prefix-cache scope (the gateway sends the tenant): prompts reuse KV only within one salt."""
    public_prefix_tokens: int = 0
    """Leading prompt tokens the operator marked public: their KV is shared across salts."""
    kv_session: KVSessionRef | None = None
    """The conversation this turn belongs to: its new KV blocks go to the cache nodes (data_plane/shard/kv_tier.py)."""
    grammar: CompiledGrammar | None = None
    """`params.grammar` compiled (the engine's `prepare` sets it, off the scheduler thread)."""
    resumed_text: str = ""
    """A resumed stream's output already sent (the prompt ends with it, `continue_final_message`): the
    grammar's matcher consumes it before the first step, so the continuation continues the grammar, and a
    seeded sample's draws go on from the position after it (torch_sampling.Draws)."""
    processor: Any = None  # a logits.RequestLogits (that module imports this one)
    """Per-request logits state the engine builds at enqueue when params need it (engines/logits.py)."""
    trace: Any = None
    """The request's span (an OTel SpanContext, set by the shard's app): the engine's own spans for it
    (a pipeline's KV block ops, pipeline_kv.py) are its children."""


@dataclass(frozen=True)
class RequestTimings:
    queued_s: float
    prefill_s: float
    decode_s: float
    first_token_at: float | None


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage's part of a request (data_plane/shard/engines/pipeline.py): the wall-clock
    span (epoch seconds) from the first pass of the request's that reached the stage to the last that
    left it, and the stage's compute in those passes."""

    stage: int
    start: float
    end: float
    busy_s: float
    passes: int


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely alternatives (OpenAI's logprobs entry; the
    token's text and bytes are the API layer's to render)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationOutput:
    text: str
    """New text since the previous output (may be empty)."""
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    timings: RequestTimings | None = None
    """Set on the final output only."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not recomputed)."""
    spec_drafts: int = 0
    """Speculative decoding, final output only: drafts proposed for this request ..."""
    spec_draft_tokens: int = 0
    """... the tokens in them ..."""
    spec_accepted_tokens: int = 0
    """... and how many of those the model accepted."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """With params.logprobs: the tokens sampled since the previous output (their text may lag in `text`)."""
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    """With params.prompt_logprobs, on the first output only: one entry per prompt token, the first None (nothing
    predicts it), each the model's raw distribution at that position (prompt_logprobs.py)."""
    stages: tuple[StageSpan, ...] = ()
    """Final output of a pipelined shard's request only: each stage's part (the shard's span per stage)."""


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    max_num_seqs: int
    prefix_cache_blocks: int = 0
    """Blocks held by the prefix cache (referenced or not)."""
    prefix_cache_block_bytes: int = 0
    prefix_cache_capacity_bytes: int = 0


class Engine(Protocol):
    """What a shard needs from an engine. `start` is awaited once before serving,
    `aclose` once at shutdown; `generate` may be called concurrently from any task."""

    model_name: str
    max_model_len: int
    system_fingerprint: str
    """What decides this engine's numerics, named (fingerprint.py): every body and chunk says it."""

    def encode_chat(self, messages: Sequence[dict[str, str]], continue_final: bool = False) -> list[int]:
        """Chat template -> token ids; `continue_final` continues the last assistant message."""
        ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Validate and enqueue now (raise InvalidRequest / Overloaded before any compute);
        return the outputs. Closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


def check_lengths(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """Validate a request against the context window; return the effective max_tokens."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty", param="messages")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if prompt_len >= max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens; "
            f"the messages use {prompt_len} tokens",
            param="messages",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens; the messages use "
            f"{prompt_len} tokens and max_tokens asks for {max_tokens} more "
            f"(at most {max_model_len - prompt_len} fit)",
            param="max_tokens",
        )
    return max_tokens


class StopStrings:
    """Stop strings over text that arrives in pieces: what is safe to send now, and whether a stop string
    was produced. A tail that could still become a stop string is held back, so one is never half-sent.

        stops = StopStrings(("\\n\\n",))
        piece = stops.feed(text)       # up to a stop string (then `stopped`), or all but a held-back tail
        tail = stops.flush()           # at the end: whatever was held back

    Used by :class:`TextStream` (the engine's text) and by choices.ContentStop (a tool-mode reply's content,
    where the engine's text is the tool envelope)."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self._emitted = 0
        self._floor = 0
        """How much of the text came before the stop strings were `armed`: a match must end past it."""
        self.stopped = False

    def feed(self, piece: str, armed: bool = True) -> str:
        """With `armed` False (a reply still short of its `min_tokens`) no stop string ends the text, as in
        vLLM, whose detokenizer checks them only past `min_tokens`; a tail that may become one is held."""
        if self.stopped:
            return ""
        self.text += piece
        if not self.stop:
            return self._take(len(self.text))
        if not armed:
            self._floor = len(self.text)
            return self._take(len(self.text) - self._held_back())
        search_from = max(0, self._emitted - self._max_stop)
        cut = min((i for i in (self.text.find(s, max(search_from, self._floor - len(s) + 1)) for s in self.stop)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def flush(self) -> str:
        return self._take(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.text
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


class TextStream:
    """Incremental detokenizer with stop strings for one request.

    Emits text that never splits a multi-byte character (a trailing U+FFFD means the
    token ended mid-character, so we wait for the next one), and holds back any tail that
    could still become a stop string so a stop string is never half-sent (:class:`StopStrings`).

        ts = TextStream(tokenizer.decode, stop=("\\n\\n",))
        delta = ts.push(token_id)      # "" while undecidable
        if ts.stopped: ...             # a stop string was produced; finish with "stop"
        tail = ts.flush()              # at the end: whatever was held back
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._decode = decode
        self._stops = StopStrings(stop)
        self._min_tokens = min_tokens
        """The stop strings count only once the reply has more tokens than this (vLLM's `min_tokens`)."""
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        if self._stops.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._stops.feed(full[len(prefix) :], armed=len(self._ids) > self._min_tokens)

    def flush(self) -> str:
        return self._stops.flush()

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def text(self) -> str:
        return self._stops.text
