"""Per-request logits processing in the batched step: grammar masks, penalties, bias, EOS bans, logprobs.

    proc = RequestLogits.build(params, compiled_grammar, eos_ids, prompt_ids, vocab, listener)  # None: plain
    tokens = sample(logits, params, generators, [proc, None, ...])   # torch_sampling: process, sample, accept

`process_batch` runs once per step over the rows that have a processor (the others are untouched,
so an unconstrained batch pays nothing): it records the raw log-probabilities the request asked for
(vLLM's default `raw_logprobs`: the model's distribution before any processing), then applies, in
vLLM's order, the grammar's token mask (one int32 bitmask row per constrained sequence, filled by
llguidance on the CPU and applied to the logits with one masked_fill over the constrained rows),
`logit_bias`, the EOS ban of `min_tokens` / `ignore_eos`, `repetition_penalty` (prompt and output
tokens), then `frequency_penalty` / `presence_penalty` (output tokens, OpenAI's formula). Temperature,
top_k, top_p and min_p follow in the sampler. `accept` then advances each processor by its sampled
token (the grammar matcher, the output counts, the logprobs entry).

Scheduler thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from data_plane.shard.engines.base import SamplingParams, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)


class MaskListener(Protocol):
    def on_grammar_mask(self, rows: int, seconds: float) -> None: ...


class RequestLogits:
    """One sequence's processing state (see the module docstring). Built only for requests that need it."""

    def __init__(self, params: SamplingParams, matcher: Any, eos_ids: Sequence[int], prompt_ids: Sequence[int],
                 vocab: int, listener: MaskListener | None = None, mask_vocab: int = 0) -> None:
        self.params = params
        self.matcher = matcher
        self.mask_vocab = mask_vocab or vocab
        self.eos_ids = sorted(eos_ids)
        self.vocab = vocab
        self.listener = listener
        self.generated = 0
        self.logprobs: list[TokenLogprob] = []
        """Entries not yet handed out (`drain`)."""
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            ids = torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long)
            self.seen[ids] = True
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            self.bias = (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long),
                         torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
        self.error: str | None = None

    @classmethod
    def build(cls, params: SamplingParams, grammar: Any, eos_ids: Sequence[int], prompt_ids: Sequence[int],
              vocab: int, listener: MaskListener | None = None) -> RequestLogits | None:
        """A processor when `params` or a compiled grammar asks for any processing, else None."""
        if grammar is None and not params.processed:
            return None
        if grammar is None:
            return cls(params, None, eos_ids, prompt_ids, vocab, listener)
        return cls(params, grammar.matcher(), eos_ids, prompt_ids, vocab, listener, grammar.vocab_size)

    # -- per step ----------------------------------------------------------------------------

    def _ban_eos(self) -> bool:
        p = self.params
        if self.matcher is not None and self.matcher.is_stopped():
            return False
        return p.ignore_eos or self.generated < p.min_tokens

    def _record(self, raw: torch.Tensor) -> None:
        self._raw = torch.log_softmax(raw.float(), dim=-1)

    def accept(self, token: int) -> None:
        """`token` was sampled for this sequence."""
        p = self.params
        if p.logprobs:
            lp = self._raw
            top: tuple[TopLogprob, ...] = ()
            if p.top_logprobs:
                vals, ids = torch.topk(lp, p.top_logprobs)
                top = tuple(TopLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()))
            if token not in self.eos_ids:
                self.logprobs.append(TokenLogprob(token, float(lp[token]), top))
        self.generated += 1
        if self.counts is not None and 0 <= token < self.vocab:
            self.counts[token] += 1
        if self.seen is not None and 0 <= token < self.vocab:
            self.seen[token] = True
        m = self.matcher
        if (m is not None and self.error is None and not m.is_stopped()
                and (not m.consume_token(token) or m.is_error())):
            self.error = m.get_error() or "token rejected"
            log.warning("grammar matcher error after token %d: %s", token, self.error)

    # -- speculation (torch_spec.py): drafts checked against the grammar ---------------------------------

    @property
    def drafts(self) -> bool:
        """Whether this sequence may draft: a live grammar and nothing else that depends on the position
        (penalties, bias, EOS bans, logprobs are applied one token a step: those sequences never draft)."""
        p = self.params
        return (self.matcher is not None and self.error is None and not self.matcher.is_stopped()
                and self.counts is None and self.seen is None and self.bias is None
                and not (p.logprobs or p.min_tokens or p.ignore_eos))

    def check_draft(self, draft: Sequence[int]) -> list[int]:
        """`draft` cut at the first token the grammar rejects (or an EOS: the model's own token ends it)."""
        ok = list(draft[: self.matcher.validate_tokens(list(draft))])
        for j, t in enumerate(ok):
            if t in self.eos_ids:
                return ok[:j]
        return ok

    def mask_draft(self, rows: torch.Tensor, draft: Sequence[int]) -> None:
        """Mask the verify rows of a checked `draft` (row j: what may follow draft[:j]) in place: the
        matcher walks the draft filling one bitmask row per position (it is left past the draft: `settle`)."""
        import llguidance.torch as lt

        t0 = time.monotonic()
        bitmask = lt.allocate_token_bitmask(len(draft) + 1, self.mask_vocab)
        for j in range(len(draft) + 1):
            lt.fill_next_token_bitmask(self.matcher, bitmask, j)
            if j < len(draft) and not self.matcher.consume_token(draft[j]):
                raise AssertionError("a checked draft token was rejected")
        _mask_rows(rows, bitmask)
        if self.listener is not None:
            self.listener.on_grammar_mask(len(draft) + 1, time.monotonic() - t0)

    def settle(self, drafted: int, tokens: Sequence[int]) -> None:
        """The verify step kept `tokens` (the accepted drafts, then the model's token): the matcher, past
        all `drafted` tokens since `mask_draft`, is rolled back to the accepted ones and takes the last."""
        accepted = len(tokens) - 1
        self.matcher.rollback(drafted - accepted)
        self.generated += accepted
        self.accept(tokens[-1])

    def drain(self) -> tuple[TokenLogprob, ...]:
        out, self.logprobs = tuple(self.logprobs), []
        return out

    def _penalize(self, row: torch.Tensor) -> None:
        p = self.params
        if self.bias is not None:
            ids, vals = self.bias
            row.index_add_(0, ids, vals.to(row.dtype))
        if self._ban_eos():
            row[self.eos_ids] = float("-inf")
        if self.seen is not None:
            rp = p.repetition_penalty
            sel = row[self.seen]
            row[self.seen] = torch.where(sel > 0, sel / rp, sel * rp)
        if self.counts is not None:
            row -= (p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).float()).to(row.dtype)


def process_batch(logits: torch.Tensor, procs: Sequence[RequestLogits | None]) -> None:
    """Apply every processor to its row of `logits` [n, vocab], in place (see the module docstring)."""
    rows = [i for i, p in enumerate(procs) if p is not None]
    if not rows:
        return
    for i in rows:
        proc = procs[i]
        assert proc is not None
        if proc.params.logprobs:
            proc._record(logits[i])
    constrained = [i for i in rows if _constrains(procs[i])]
    if constrained:
        _apply_grammar(logits, constrained, procs)
    for i in rows:
        proc = procs[i]
        assert proc is not None
        proc._penalize(logits[i])


def _constrains(proc: RequestLogits | None) -> bool:
    return proc is not None and proc.matcher is not None and proc.error is None


def _apply_grammar(logits: torch.Tensor, rows: list[int], procs: Sequence[RequestLogits | None]) -> None:
    """Fill one bitmask row per constrained sequence (llguidance, on the CPU) and mask their logits at once."""
    import llguidance.torch as lt

    t0 = time.monotonic()
    first = procs[rows[0]]
    assert first is not None
    bitmask = lt.allocate_token_bitmask(len(rows), first.mask_vocab)
    for k, i in enumerate(rows):
        proc = procs[i]
        assert proc is not None
        lt.fill_next_token_bitmask(proc.matcher, bitmask, k)
    index = torch.tensor(rows, dtype=torch.long)
    sub = logits.index_select(0, index)
    _mask_rows(sub, bitmask)
    logits.index_copy_(0, index, sub)
    if first.listener is not None:
        first.listener.on_grammar_mask(len(rows), time.monotonic() - t0)


def _mask_rows(rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, on every token of `rows` [n, vocab] that `bitmask` [n, words] does not allow (tokens past
    the tokenizer's vocabulary, padding in the model's, are never allowed)."""
    vocab = rows.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(rows.shape[0], -1)
    width = min(vocab, allowed.shape[1])
    blocked = torch.ones(rows.shape[0], vocab, dtype=torch.bool)
    blocked[:, :width] = ~allowed[:, :width]
    rows.masked_fill_(blocked, float("-inf"))
