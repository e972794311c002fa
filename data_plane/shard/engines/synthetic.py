"""A synthetic engine: instant, deterministic tokens. For stack benchmarks and tests only.

    switchboard shard --engine synthetic --synthetic-token-delay-ms 0

It tokenizes by whitespace and answers with words derived from the prompt, so every
layer above the engine (gateway, router, cache, SSE) can be measured without the model's
cost. An answer ends after 16 tokens, or runs to max_tokens with `ignore_eos` (vLLM's meaning; a
test that needs a long request sends it). It is never a default.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from data_plane.shard.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    RequestTimings,
    TextStream,
    check_lengths,
)
from data_plane.shard.engines.fingerprint import Numerics

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
DEFAULT_ANSWER_TOKENS = 16


class SyntheticEngine:
    model_name = "synthetic"
    system_fingerprint = Numerics(engine="synthetic", model="synthetic").fingerprint()
    """Its words are a hash of the prompt: one numerics whatever the settings (fingerprint.py)."""
    honours = ("ignore_eos",)
    """Sampling parameters beyond the plain ones this engine serves without a logits processor (the shard
    refuses the others, data_plane/shard/choices.py): `ignore_eos` answers run to max_tokens, as vLLM's do."""

    def __init__(self, max_model_len: int = 2048, token_delay_s: float = 0.0, max_num_seqs: int = 256,
                 listener: Any = None) -> None:
        self.listener = listener  # a StepListener: so the shard's step/latency metrics exist here too
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.max_num_seqs = max_num_seqs
        self._words: dict[int, str] = {}
        self._running = 0
        self._aborted: set[str] = set()

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    @staticmethod
    def _id(word: str) -> int:
        """A stable id per word (the same in every process, so shards agree)."""
        return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big")

    def _output_id(self, word: str) -> int:
        token = self._id(word)
        self._words.setdefault(token, word)  # only the few output words are ever decoded
        return token

    def encode_chat(self, messages: Sequence[dict[str, str]], continue_final: bool = False) -> list[int]:
        ids = []
        for m in messages:
            ids.append(self._id(f"<{m['role']}>"))
            ids.extend(self._id(w) for w in m["content"].split())
        if not continue_final:
            ids.append(self._id("<assistant>"))
        return ids

    def encode_text(self, text: str, first: bool = True) -> list[int]:
        """A raw prompt's text (the legacy Completions API): its words, no template."""
        return [self._id(w) for w in text.split()]

    def _decode(self, ids: list[int]) -> str:
        return "".join(" " + self._words.get(i, "") for i in ids)

    def stats(self) -> EngineStats:
        return EngineStats(self._running, 0, 0.0, self.max_num_seqs)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        max_tokens = check_lengths(len(req.prompt_ids), req.params.max_tokens, self.max_model_len)
        return self._run(req, max_tokens)

    async def _run(self, req: GenerationRequest, max_tokens: int) -> AsyncIterator[GenerationOutput]:
        t0 = time.monotonic()
        # Words depend on the prompt up to the reply marker, and continue from the words already
        # in a continued reply, so a resumed stream equals an uninterrupted one.
        marker = self._id("<assistant>")
        cut = max((i for i, t in enumerate(req.prompt_ids) if t == marker), default=len(req.prompt_ids) - 1)
        seed = hashlib.blake2b(bytes(str(req.prompt_ids[: cut + 1]), "ascii"), digest_size=4).digest()[0]
        done = len(req.prompt_ids) - cut - 1
        seed += done
        # An answer ends by itself after DEFAULT_ANSWER_TOKENS (its "EOS"); with ignore_eos it runs to
        # max_tokens (stop strings still end it), as on the torch engine and vLLM.
        n = max_tokens if req.params.ignore_eos else min(max_tokens, max(0, DEFAULT_ANSWER_TOKENS - done))
        if n == 0:
            yield self._final(req, "", FINISH_STOP, 0, t0, time.monotonic())
            return
        stream = TextStream(self._decode, req.params.stop, req.params.min_tokens)
        first = None
        self._running += 1
        if self.listener is not None:
            self.listener.on_admit(time.monotonic() - req.arrival)
        last = time.monotonic()
        try:
            for i in range(n):
                if req.request_id in self._aborted:
                    self._aborted.discard(req.request_id)
                    yield GenerationOutput("", FINISH_ABORT, len(req.prompt_ids), i)
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                now = time.monotonic()
                if self.listener is not None:
                    self.listener.on_step(self._running, now - last, "decode")
                    self.listener.on_iteration_tokens(1)  # one token per (per-request) step here
                    if first is None:
                        self.listener.on_first_token(now - req.arrival, 0.0)
                    else:
                        self.listener.on_token(now - last)
                last = now
                first = first or now
                delta = stream.push(self._output_id(_WORDS[(seed + i) % len(_WORDS)]))
                if stream.stopped:
                    yield self._final(req, delta + stream.flush(), FINISH_STOP, i + 1, t0, first)
                    return
                if i == n - 1:
                    reason = FINISH_LENGTH if n == max_tokens else FINISH_STOP
                    yield self._final(req, delta + stream.flush(), reason, n, t0, first)
                    return
                if delta:
                    yield GenerationOutput(delta, None, len(req.prompt_ids), i + 1)
        finally:
            self._running -= 1

    def _final(self, req, text, reason, n, t0, first) -> GenerationOutput:  # type: ignore[no-untyped-def]
        now = time.monotonic()
        return GenerationOutput(text, reason, len(req.prompt_ids), n, RequestTimings(0.0, 0.0, now - t0, first))
