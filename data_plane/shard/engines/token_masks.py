"""Grammar token masks: int32 bitmasks filled by llguidance, applied to logits in one op, filled ahead.

    bitmask = allocate(rows, vocab)                 # [rows, ceil(vocab / 32)] int32, every token allowed
    fill(matcher, bitmask, k)                       # row k: the tokens `matcher` allows next
    apply(logits, bitmask)                          # -inf on every token a row's mask forbids, in place
    prefetch = MaskPrefetch(listener)               # the executor's: one worker thread
    prefetch.start([(proc, draft), ...])            # before the forward pass: fill in the worker
    mask = proc.take_mask()                         # after it (logits.RequestLogits): waits, then the bitmask

What vLLM v1 does (vllm/v1/structured_output: the bitmask for a step is filled on the CPU while the
model runs, then applied to the logits in one op) is what `MaskPrefetch` does: the mask a sequence needs
at step t depends only on the tokens it has taken up to t-1, which `accept` has already fed its matcher
when the step is planned, so the executor starts the fill (llguidance releases the GIL) before the
forward pass and the sampler collects it after. Plain rows are filled by one batched llguidance call
(`LLExecutor.unsafe_compute_mask_ptr`, Rust threads over the rows); a speculative row's matcher walks its
draft, one bitmask row per verified position (it is left past the draft: `RequestLogits.settle` rolls
it back). `llguidance.torch` is not used: importing it pulls in torch.compile (seconds, once, on the
scheduler thread), and its masking kernel is compiled for GPUs.

A matcher is touched by one thread at a time: the worker between `start` and `take_mask`, the
scheduler thread otherwise (the sampler waits for the fill before it reads or advances a matcher).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

_BITS = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32)
"""Bit b of an int32 word (bit 31 is the sign bit)."""


class MaskListener(Protocol):
    def on_grammar_mask(self, rows: int, seconds: float) -> None: ...


class Masked(Protocol):
    """What the prefetch needs of a sequence's processor (logits.RequestLogits)."""

    matcher: Any
    mask_vocab: int
    pending: Future[None] | None
    ready: torch.Tensor | None
    error: str | None


def allocate(rows: int, vocab: int) -> torch.Tensor:
    """A bitmask of `rows` rows for a vocabulary of `vocab` tokens, every bit set."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def fill(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of `bitmask`: the tokens `matcher` allows next (llguidance, GIL released)."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, on every token of `logits` [n, vocab] that `bitmask` [n, words] does not allow
    (tokens past the tokenizer's vocabulary, padding in the model's, are never allowed)."""
    n, vocab = logits.shape
    allowed = (bitmask.unsqueeze(-1) & _BITS).ne(0).view(n, -1)
    width = min(vocab, allowed.shape[1])
    logits[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    if vocab > width:
        logits[:, width:] = float("-inf")


def walk(matcher: Any, draft: Sequence[int], vocab: int) -> tuple[torch.Tensor, str | None]:
    """[len(draft) + 1, words]: row j, what `matcher` allows after draft[:j]; the matcher is left past
    the draft. Drafts are checked before they are planned, but a parser limit can still stop the matcher
    on one (llguidance's "Too many items" on a schema whose every output recurses forever): the walk ends
    there with the matcher's error (the rows after it allow every token; the sequence fails, `RequestLogits`).
    It was an AssertionError on the scheduler thread: one client's schema killed the shard's engine."""
    bitmask = allocate(len(draft) + 1, vocab)
    for j in range(len(draft) + 1):
        fill(matcher, bitmask, j)
        if j < len(draft) and not matcher.consume_token(draft[j]):
            return bitmask, matcher.get_error() or "a checked draft token was rejected"
    return bitmask, None


class MaskPrefetch:
    """Fills a step's masks in one worker thread while the forward pass runs (see the module docstring)."""

    def __init__(self, listener: MaskListener | None = None) -> None:
        self.listener = listener
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._par: Any = None  # an llguidance.LLExecutor, made on first use

    def start(self, work: Sequence[tuple[Masked, Sequence[int]]]) -> None:
        """Fill, in the worker, each processor's mask for this step: `draft` empty, one row (the next
        token); else one row per verified position. Each processor's `take_mask` then waits for it."""
        if not work:
            return
        job = self._pool.submit(self._fill, list(work))
        for proc, _ in work:
            proc.pending = job

    def _fill(self, work: list[tuple[Masked, Sequence[int]]]) -> None:
        t0 = time.monotonic()
        plain = [p for p, d in work if not d]
        if len(plain) > 1:
            if self._par is None:
                import llguidance

                self._par = llguidance.LLExecutor()
            bitmask = allocate(len(plain), plain[0].mask_vocab)
            self._par.unsafe_compute_mask_ptr([(p.matcher, k) for k, p in enumerate(plain)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, len(plain))
            for k, p in enumerate(plain):
                p.ready = bitmask[k : k + 1]
        elif plain:
            plain[0].ready = bitmask = allocate(1, plain[0].mask_vocab)
            fill(plain[0].matcher, bitmask, 0)
        rows = len(plain)
        for p, d in work:
            if d:
                p.ready, failed = walk(p.matcher, d, p.mask_vocab)
                p.error = p.error or failed
                rows += len(d) + 1
        if self.listener is not None:
            self.listener.on_grammar_mask(rows, time.monotonic() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
