"""Per-request logits processing in the batched step: grammar masks, penalties, bias, EOS bans, logprobs.

    proc = RequestLogits.build(params, compiled_grammar, eos_ids, prompt_ids, vocab, listener, made)  # None: plain
    tokens = sample(logits, params, generators, [proc, None, ...])   # torch_sampling: process, sample, accept

`process_batch` runs once per step over the rows that have a processor (the others are untouched,
so an unconstrained batch pays nothing): it records the raw log-probabilities the request asked for
(vLLM's default `raw_logprobs`: the model's distribution before any processing), then applies, in
vLLM's order, the grammar's token mask (one int32 bitmask row per constrained sequence, filled by
llguidance on the CPU, while the forward pass runs, and applied to the logits in one op over the
constrained rows: token_masks.py),
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
from concurrent.futures import Future
from typing import Any

import torch

from data_plane.common.errors import InvalidRequest
from data_plane.shard.engines import token_masks
from data_plane.shard.engines.base import SamplingParams, TokenLogprob, TopLogprob
from data_plane.shard.engines.grammar import GrammarKind
from data_plane.shard.engines.token_masks import MaskListener

log = logging.getLogger(__name__)


class RequestLogits:
    """One sequence's processing state (see the module docstring). Built only for requests that need it."""

    def __init__(self, params: SamplingParams, matcher: Any, eos_ids: Sequence[int], prompt_ids: Sequence[int],
                 vocab: int, listener: MaskListener | None = None, mask_vocab: int = 0, made: int = 0) -> None:
        self.params = params
        self.matcher = matcher
        self.mask_vocab = mask_vocab or vocab
        self.eos_ids = sorted(eos_ids)
        self.vocab = vocab
        self.listener = listener
        self.generated = made
        """Output tokens so far: a resumed stream's `made` (the prompt's last tokens) count, for min_tokens."""
        self.logprobs: list[TokenLogprob] = []
        """Entries not yet handed out (`drain`)."""
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32)
            if made:  # output already sent before a resume: penalized as an unbroken stream's output is
                ids = torch.tensor([t for t in prompt_ids[len(prompt_ids) - made:] if 0 <= t < vocab], dtype=torch.long)
                self.counts.index_add_(0, ids, torch.ones(len(ids)))
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            ids = torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long)
            self.seen[ids] = True
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            self.bias = (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long),
                         torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
        self.error: str | None = None
        self.pending: Future[None] | None = None
        """This step's mask fill in the executor's worker (token_masks.MaskPrefetch), until `take_mask`."""
        self.ready: torch.Tensor | None = None

    @classmethod
    def build(cls, params: SamplingParams, grammar: Any, eos_ids: Sequence[int], prompt_ids: Sequence[int],
              vocab: int, listener: MaskListener | None = None, made: int = 0) -> RequestLogits | None:
        """A processor when `params` or a compiled grammar asks for any processing, else None; `made`: a
        resumed stream's output tokens already sent (the last of `prompt_ids`)."""
        if grammar is None and not params.processed:
            return None
        if grammar is None:
            return cls(params, None, eos_ids, prompt_ids, vocab, listener, made=made)
        return cls(params, grammar.matcher(), eos_ids, prompt_ids, vocab, listener, grammar.vocab_size, made)

    # -- per step ----------------------------------------------------------------------------

    def take_mask(self) -> torch.Tensor | None:
        """This step's prefetched bitmask (waiting for the worker to finish it), or None when none was
        started (the caller fills it now)."""
        job, self.pending = self.pending, None
        if job is None:
            return None
        job.result()
        mask, self.ready = self.ready, None
        return mask

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
        if m is not None and self.error is None and (m.is_error() or (
                not m.is_stopped() and (not m.consume_token(token) or m.is_error()))):
            self.error = m.get_error() or "token rejected"
            log.warning("grammar matcher error after token %d: %s", token, _first_line(self.error))

    def failure(self) -> InvalidRequest | None:
        """The 400 this sequence ends with once its grammar stopped short of a whole output (`error`): a
        parser limit, or a dead end (a $ref cycle inside the schema: the mask then allows only EOS). It was
        served on, unconstrained, or ended "stop" with the JSON cut (`{"a":`)."""
        if self.error is None:
            return None
        kind = self.params.grammar.kind if self.params.grammar is not None else GrammarKind.JSON_SCHEMA
        return InvalidRequest(
            f"{kind.noun} cannot be followed to a complete output (the grammar "
            f"engine stopped after {self.generated} tokens: {_first_line(self.error)}); a schema whose every output "
            "recurses forever (a required property that refers back to its own object, a $ref cycle) has none",
            param=_PARAMS.get(kind, "response_format"), code="invalid_grammar")

    @property
    def constrains(self) -> bool:
        """A live grammar masks this sequence's next tokens."""
        return self.matcher is not None and self.error is None

    # -- speculation (torch_spec.py): drafts checked against the grammar ---------------------------------

    @property
    def drafts(self) -> bool:
        """Whether this sequence may draft: a live grammar and nothing else that depends on the position
        (penalties, bias, EOS bans, logprobs are applied one token a step: those sequences never draft)."""
        p = self.params
        return (self.matcher is not None and self.error is None and not self.matcher.is_stopped()
                and self.counts is None and self.seen is None and self.bias is None
                and not (p.logprobs or p.min_tokens or p.ignore_eos))

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces from here (llguidance `compute_ff_tokens`: the forced
        bytes, tokenized, short of a token a longer match could replace); empty when it forces none or
        this sequence may not draft."""
        if not self.drafts:
            return []
        return self.check_draft(self.matcher.compute_ff_tokens()[:limit])

    def check_draft(self, draft: Sequence[int]) -> list[int]:
        """`draft` cut at the first token the grammar rejects (or an EOS: the model's own token ends it)."""
        ok = list(draft[: self.matcher.validate_tokens(list(draft))])
        for j, t in enumerate(ok):
            if t in self.eos_ids:
                return ok[:j]
        return ok

    def mask_draft(self, rows: torch.Tensor, draft: Sequence[int]) -> None:
        """Mask the verify rows of a checked `draft` (row j: what may follow draft[:j]) in place: the
        matcher walks the draft filling one bitmask row per position (it is left past the draft: `settle`).
        The walk was usually done during the forward pass (token_masks.MaskPrefetch)."""
        bitmask = self.take_mask()
        if bitmask is None:
            t0 = time.monotonic()
            bitmask, failed = token_masks.walk(self.matcher, draft, self.mask_vocab)
            self.error = self.error or failed
            if self.listener is not None:
                self.listener.on_grammar_mask(len(draft) + 1, time.monotonic() - t0)
        token_masks.apply(rows, bitmask)

    def settle(self, drafted: int, tokens: Sequence[int]) -> None:
        """The verify step kept `tokens` (the accepted drafts, then the model's token): the matcher, past
        all `drafted` tokens since `mask_draft`, is rolled back to the accepted ones and takes the last."""
        accepted = len(tokens) - 1
        if self.error is not None:  # the walk stopped on a draft token: the sequence fails (`failure`)
            self.generated += len(tokens)
            return
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


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:200] if error.strip() else error


_PARAMS = {GrammarKind.TOOLS: "tools", GrammarKind.REGEX: "structured_outputs", GrammarKind.CHOICE: "structured_outputs",
           GrammarKind.GRAMMAR: "structured_outputs"}
"""The request field a grammar kind comes from (a JSON schema or object: response_format)."""


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
    return proc is not None and proc.constrains


def _apply_grammar(logits: torch.Tensor, rows: list[int], procs: Sequence[RequestLogits | None]) -> None:
    """The constrained rows' bitmasks (prefetched during the forward pass, or filled now by llguidance on
    the CPU), applied to their logits in one op."""
    masks: list[torch.Tensor] = []
    t0, late = time.monotonic(), 0
    for i in rows:
        proc = procs[i]
        assert proc is not None
        mask = proc.take_mask()
        if mask is None:
            mask = token_masks.allocate(1, proc.mask_vocab)
            token_masks.fill(proc.matcher, mask, 0)
            late += 1
        masks.append(mask)
    bitmask = masks[0] if len(masks) == 1 else torch.cat(masks)
    if len(rows) == logits.shape[0]:
        token_masks.apply(logits, bitmask)
    else:
        index = torch.tensor(rows, dtype=torch.long)
        sub = logits.index_select(0, index)
        token_masks.apply(sub, bitmask)
        logits.index_copy_(0, index, sub)
    first = procs[rows[0]]
    if late and first is not None and first.listener is not None:
        first.listener.on_grammar_mask(late, time.monotonic() - t0)
