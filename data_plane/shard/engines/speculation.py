"""N-gram (prompt-lookup) speculative decoding: drafting, adaptive draft length, acceptance.

Used by the speculative decode step (data_plane/shard/engines/torch_spec.py); each sequence keeps
its :class:`SeqSpec` in its ``SeqState`` (data_plane/shard/engines/torch_config.py).

    index = NgramIndex(min_n=2, max_n=4)
    draft = index.propose(prompt_ids + output_ids, k=4)    # up to 4 tokens that followed the tail before
    state = SeqSpec(max_k=4)
    k = state.draft_len()                                   # 0 while backed off
    tokens = accept_greedy(draft, argmax_rows)              # accepted drafts + one model token
    tokens = accept_sampled(draft, probs_rows, generator)   # the same, distribution-exact
    state.record(len(draft), len(tokens) - 1)

The draft needs no draft model: the most recent earlier occurrence of the sequence's last n
tokens (n from max_n down to min_n) in prompt + output proposes the tokens that followed it
(transformers' `prompt_lookup_num_tokens`, vLLM's `method: ngram`). The target model scores
the last token plus the draft in one pass (data_plane/shard/engines/spec_runner.py); row j's logits say
what follows draft token j.

Acceptance keeps the output distribution exact. Greedy: accept while the draft equals the
argmax, then the argmax at the first mismatch (or after the last draft) is the bonus token.
Sampling: vLLM's rejection sampler with the draft probability taken as 1 (an n-gram draft is a
point mass): accept draft x with probability p(x); on rejection sample from p with x removed
and renormalised, i.e. (p - q)+ / |p - q|+ with q = one-hot(x). If every draft is accepted, the
bonus token is sampled from the last row. `p` is the request's own processed distribution
(temperature, top_k, top_p: `target_probs`), the same one the non-speculative path samples.

"Never slower": a sequence's draft length adapts (full acceptance grows it, a rejection at
position j cuts it to j + 1), `miss_limit` drafts in a row with nothing accepted turn drafting
off for that sequence for a back-off that doubles each time, and the engine drafts for no one
when more than `max_batch` sequences run (EngineConfig.spec_max_batch, measured: see
docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from data_plane.shard.engines.base import SamplingParams

MAX_BACKOFF_STEPS = 256
"""Longest pause of drafting for one sequence after repeated misses (decode steps)."""


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of a growing token list last ended.

    Indexed incrementally: `propose` only hashes the tokens appended since its last call, so a
    step costs O(new tokens), not O(context)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        tail of `tokens` (an append-only list: the same one every call); [] when none matches."""
        if k <= 0:
            return []
        last = len(tokens) - 1  # the tail n-gram ends at `last`; only earlier ends are indexed
        for end in range(self._indexed, last):
            for n, table in self._ends.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            at = self._ends[n].get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return list(tokens[at : at + k])
        return []


@dataclass
class SeqSpec:
    """One sequence's speculation state: adaptive draft length, back-off, and its totals."""

    max_k: int = 8
    miss_limit: int = 3
    k: int = 0
    misses: int = 0
    cooldown: int = 0
    backoff: int = 16
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    index: NgramIndex = field(default_factory=NgramIndex)

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def draft_len(self) -> int:
        """How many tokens to draft this step (0 while backed off); call once per decode step."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.k = min(self.max_k, self.k + 1) if accepted == drafted else max(1, accepted + 1)
        if accepted == 0:
            self.misses += 1
            if self.misses >= self.miss_limit:
                self.cooldown, self.misses = self.backoff, 0
                self.backoff = min(MAX_BACKOFF_STEPS, self.backoff * 2)
        else:
            self.misses = 0


def accept_greedy(draft: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """`argmax[j]` is the model's choice after draft token j-1 (row 0: after the last real
    token); returns the accepted drafts plus the model's token at the first mismatch."""
    out: list[int] = []
    for j, x in enumerate(draft):
        if argmax[j] != x:
            break
        out.append(x)
    out.append(int(argmax[len(out)]))
    return out


def accept_sampled(draft: Sequence[int], probs: torch.Tensor, gen: torch.Generator | None) -> list[int]:
    """Rejection sampling for a point-mass draft: `probs` [len(draft)+1, vocab] are the target
    distributions (rows as in `accept_greedy`). Exact: the tokens have the law of sampling `probs`
    one step at a time."""
    out: list[int] = []
    for j, x in enumerate(draft):
        p = probs[j]
        u = float(torch.rand((), generator=gen))
        if u < float(p[x]):
            out.append(int(x))
            continue
        residual = p.clone()
        residual[x] = 0.0
        if float(residual.sum()) <= 0.0:  # p(x) == 1 up to rounding: x is the only choice
            out.append(int(x))
            continue
        out.append(int(torch.multinomial(residual, 1, generator=gen).item()))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=gen).item()))
    return out


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The request's sampling distribution per row: temperature, then top_k, then top_p (rows of
    `logits` [rows, vocab]); the same processing as the engine's one-token sampler."""
    x = logits.float() / max(p.temperature, 1e-5)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, dim=-1)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)
