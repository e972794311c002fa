"""N-gram (prompt-lookup) speculative decoding: drafting, adaptive draft length, acceptance.

Used by the speculative decode step (data_plane/shard/engines/torch_spec.py); each sequence keeps
its :class:`SeqSpec` in its ``SeqState`` (data_plane/shard/engines/sequence.py).

    index = NgramIndex(min_n=1, max_n=4)
    n, at = index.match(ctx)                                # ctx = prompt_ids + output_ids; None: no match
    state = SeqSpec(max_k=15, evidence=shared.prior(), shared=shared)  # shared = SharedEvidence()
    k = state.draft_len(cost.row_cost(batch=1), n)          # 0 while backed off (cost: VerifyCost)
    draft = ctx[at : at + k]                                # what followed the tail's latest occurrence
    tokens = accept_greedy(draft, argmax_rows)              # accepted drafts + one model token
    tokens = accept_sampled(draft, lambda j: sample_row(rows[j], params, draws.at(pos + j)))  # the same, exact
    state.record(len(draft), len(tokens) - 1, n)            # evidence per match length n

The draft needs no draft model: the most recent earlier occurrence of the sequence's last n
tokens (n from max_n down to min_n = 1) in prompt + output proposes the tokens that followed it
(transformers' `prompt_lookup_num_tokens`, vLLM's `method: ngram`). The target model scores
the last token plus the draft in one pass (LlamaRunner.verify, llama_runner.py); row j's logits say
what follows draft token j.

Acceptance keeps the output distribution exact. Greedy: accept while the draft equals the
argmax, then the argmax at the first mismatch (or after the last draft) is the bonus token.
Sampling: each row is sampled as a plain step samples its position (torch_sampling.sample_row with
the position's own draw) and the draft is accepted while the samples equal it. For a point-mass draft
(an n-gram draft is one) that is rejection sampling's law: x is accepted with probability p(x), and
a rejected row's sample is p with x removed and renormalised. With position-keyed draws the tokens
are the very ones speculation off would have sampled (docs/STRUCTURED.md, "Seeds").

"Never slower": a sequence drafts only as many tokens as are expected to pay for their verify
rows (`SeqSpec.draft_len`: its acceptance so far for matches as long as this one, against what a
row costs on this machine, learnt by `VerifyCost` from the engine's own steps), backs off after
repeated misses or when even one token would not pay, and the engine drafts for no one when more
than `max_batch` sequences run (EngineConfig.spec_max_batch, measured: see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

log = logging.getLogger(__name__)

MAX_BACKOFF_STEPS = 256
"""Longest pause of drafting for one sequence after repeated misses (decode steps)."""


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of a growing token list last ended.

    Indexed incrementally: `match` only hashes the tokens appended since its last call, so a
    step costs O(new tokens), not O(context)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(n, at): the longest tail of `tokens` (an append-only list: the same one every call) that
        occurred before, n tokens long, and where its latest earlier occurrence ended; None if none."""
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
                return n, at
        return None


def _no_evidence(buckets: int = 4) -> list[list[float]]:
    return [[0.0, 0.0] for _ in range(buckets)]


def _observe(ev: list[float], decay: float, accepted: int, rejected: bool) -> None:
    """One draft into decayed [accepted tokens, rejections] evidence."""
    ev[0] = decay * ev[0] + accepted
    ev[1] = decay * ev[1] + rejected


class SharedEvidence:
    """Acceptance evidence per match length across the engine's sequences: a new sequence's prior.

    Without it every request starts at a = 0.5 and drafts 2, 5, 13 tokens while it learns what the
    last one already knew (a quote reply copies from its first tokens). The prior is worth at most
    `weight` observations, so a sequence's own drafts outweigh it after a few; one-token matches
    (n = 1) take none, as they stop by themselves and would then never be tried again."""

    def __init__(self, buckets: int = 4, decay: float = 0.9, weight: float = 16.0) -> None:
        self.decay = decay
        self.weight = weight
        self.evidence = _no_evidence(buckets)

    def observe(self, bucket: int, accepted: int, rejected: bool) -> None:
        _observe(self.evidence[bucket], self.decay, accepted, rejected)

    def prior(self) -> list[list[float]]:
        """A new sequence's starting evidence: the engine's, scaled to at most `weight` observations
        (accepted tokens + rejections) per match length; none for one-token matches."""
        out = _no_evidence(len(self.evidence))
        for b, (acc, rej) in enumerate(self.evidence[1:], start=1):
            scale = min(1.0, self.weight / (acc + rej)) if acc + rej > 0 else 0.0
            out[b] = [acc * scale, rej * scale]
        return out


@dataclass
class SeqSpec:
    """One sequence's speculation state: its acceptance evidence, draft length, back-off, totals.

    Evidence is kept per match length n (the n-gram that found the draft, 1..max_n): with `a` the
    chance a draft token is accepted once the one before it was (`accept_rate(n)`), position j yields
    a token with probability a^j, every verified row costs `row_cost` (a share of one token's decode
    time, learnt by :class:`VerifyCost`), and the draft is the longest k whose last token still pays
    for itself: k = floor(log(row_cost) / log(a)), at most max_k. (The k with the most tokens per
    unit of time, sum(a^j) / (1 + k row_cost), is ~2x shorter when rows are dear; it wins only where
    a verify pass costs nothing beyond its rows. The engine's passes have a fixed part, ~0.3 of a
    step under load, which the marginal rule's longer drafts amortise: docs/BENCHMARKS.md.)

    Per n, because how far the match reaches back is what tells a copy from a coincidence: on the
    quote workload 0.69 of the tokens 4-gram matches drafted were accepted, 0.27 and 0.22 of the 2-
    and 3-gram ones', and one rate for all drafted 15 tokens on every 2-gram match right after a
    long copy (docs/BENCHMARKS.md, "n-gram drafts by match length").

    One-token matches (n = 1, `weak`) stop by themselves when not even one such token pays.
    `miss_limit` drafts (n >= 2) in a row with nothing accepted, or a match whose rate does not pay
    for one token, turn drafting off for `backoff` steps (doubling each time, up to MAX_BACKOFF_STEPS);
    the first draft after it is one token. n = 0 (a grammar-forced draft, not an n-gram one) keeps
    no evidence."""

    max_k: int = 8
    miss_limit: int = 6
    decay: float = 0.9
    """Weight the evidence of earlier drafts keeps at each new one (recent text matters most)."""
    evidence: list[list[float]] = field(default_factory=_no_evidence)
    """[accepted tokens, rejections] (decayed) per match length n = 1.. (longer ones count as the last)."""
    shared: SharedEvidence | None = None
    """The engine's evidence across sequences, which every draft also feeds (Speculator)."""
    misses: int = 0
    cooldown: int = 0
    backoff: int = 8
    probe: bool = False
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    index: NgramIndex = field(default_factory=NgramIndex)

    def _bucket(self, n: int) -> int:
        return min(max(n, 1), len(self.evidence)) - 1

    def accept_rate(self, n: int) -> float:
        """P(a draft token is accepted | the one before it was) for a draft from an n-token match,
        Laplace-smoothed: 0.5 before any evidence."""
        accepted, rejected = self.evidence[self._bucket(n)]
        return (accepted + 1.0) / (accepted + rejected + 2.0)

    def draft_len(self, row_cost: float, n: int) -> int:
        """How many tokens to draft this step from an n-token match (0 while backed off); call once
        per decode step."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        if self.probe:  # back from a back-off: one token tells whether the text copies again
            return 1
        if row_cost <= 0.0:
            return self.max_k
        k = min(self.max_k, int(math.log(min(row_cost, 0.999)) / math.log(self.accept_rate(n))))
        if k < 1 and n >= 2:
            self._back_off()
        return max(k, 0)

    def _back_off(self) -> None:
        self.cooldown, self.misses, self.probe = self.backoff, 0, True
        self.backoff = min(MAX_BACKOFF_STEPS, self.backoff * 2)

    def record(self, drafted: int, accepted: int, n: int) -> None:
        if drafted <= 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.probe = False
        if n <= 0:
            return
        _observe(self.evidence[self._bucket(n)], self.decay, accepted, accepted < drafted)
        if self.shared is not None:
            self.shared.observe(self._bucket(n), accepted, accepted < drafted)
        if accepted:
            self.misses = 0
        elif n >= 2:
            self.misses += 1
            if self.misses >= self.miss_limit:
                self._back_off()


class CostProbe(str, Enum):
    """What the next decode step at a batch size should be, for VerifyCost to stay current."""

    NONE = "none"  # whatever pays (drafts where they pay)
    PLAIN = "plain"  # nobody drafts: re-measure the plain step the row price is taken against
    VERIFY = "verify"  # draft as if rows cost the prior: re-measure rows nobody drafts for any more


class VerifyCost:
    """What one more verified row costs, as a share of one token's decode time, per batch size:
    learnt from the engine's own steps (EWMA), so the draft length follows the machine.

        cost.plain(batch=1, seconds=0.026)                 # a decode step where nobody drafted
        cost.verify(batch=1, rows=9, seconds=0.030)        # a verify pass: 8 draft rows beside 1
        cost.row_cost(1)                                   # (0.030 - 0.026) / 8 / (0.026 / 1) = 0.019
        cost.probe(1)                                      # CostProbe.NONE, or a step to re-measure

    Until both kinds were seen at a batch size, `prior` x batch (a row's cost is nearly flat while a
    token's share of a step shrinks as 1 / batch): 0.02 from the measurement in docs/BENCHMARKS.md
    (2 cores, bf16, batch 1: 9 rows 30.0 ms against 26.4 ms for one).

    Kept current (the host's load, the intra-op thread count and the context length all move a
    step's time): once drafts pay, every step at that batch is a verify step and the plain baseline
    would never be seen again; once rows look too dear, nobody drafts and rows would never be seen
    again. So every `probe_every` observed steps at a batch size without the other kind, `probe`
    asks for one step of it (a plain step: ~1/probe_every of speculation's gain; a verify step with
    the prior's draft length). A plain step more than `drift` away from its average (x1.3 or /1.3)
    is a drift: the average takes the new time (`drift_alpha` of the way), the row average moves
    half way at each verify step, and the next probes come `probe_every // 8` steps apart until a
    plain step agrees with the average again.

    One verify step's row price counts at most `clip` times the current average (or the prior's
    price, when lower): a single slow pass (a page fault, a collection, a neighbour's burst) once
    priced rows above a whole step for the rest of a request (row cost 1.0), which stopped drafting
    until the next VERIFY probe, while a real rise still gets there in a few steps."""

    def __init__(self, prior: float = 0.02, alpha: float = 0.1, probe_every: int = 64, drift: float = 1.3,
                 drift_alpha: float = 1.0, clip: float = 3.0) -> None:
        self.prior = prior
        self.clip = clip
        self.alpha = alpha
        self.probe_every = probe_every
        self.drift = drift
        self.drift_alpha = drift_alpha
        self._step_s: dict[int, float] = {}
        self._row_s: dict[int, float] = {}
        self._since_plain: dict[int, int] = {}
        self._since_verify: dict[int, int] = {}
        self._drifting: set[int] = set()
        self.probes = {CostProbe.PLAIN: 0, CostProbe.VERIFY: 0}
        """Probe steps run, per kind (counted by the Speculator, which runs them)."""
        self.drifts = 0
        """Plain steps that moved more than `drift` from their average."""
        self._logged_at = float("-inf")

    def _ewma(self, table: dict[int, float], key: int, value: float, alpha: float | None = None) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + (self.alpha if alpha is None else alpha) * (value - old)

    def plain(self, batch: int, seconds: float) -> None:
        old = self._step_s.get(batch)
        if old is not None and old > 0.0 and not 1 / self.drift <= seconds / old <= self.drift:
            self.drifts += 1
            # one line a minute at most: on a noisy host every plain step can drift (the count is a metric)
            now = time.monotonic()
            level = logging.INFO if batch not in self._drifting and now - self._logged_at >= 60.0 else logging.DEBUG
            self._logged_at = now if level == logging.INFO else self._logged_at
            log.log(level, "decode step at batch %d moved from %.1f to %.1f ms: re-measuring the verify row cost "
                    "(%d drifts so far)", batch, 1e3 * old, 1e3 * seconds, self.drifts)
            self._drifting.add(batch)
            self._ewma(self._step_s, batch, seconds, self.drift_alpha)
            self._since_verify[batch] = self._interval(batch)  # rows are priced against the old step: re-probe
        else:
            self._drifting.discard(batch)
            self._ewma(self._step_s, batch, seconds)
            self._since_verify[batch] = self._since_verify.get(batch, 0) + 1
        self._since_plain[batch] = 0

    def verify(self, batch: int, rows: int, seconds: float) -> None:
        step = self._step_s.get(batch)
        if step is not None and rows > batch:  # while drifting, rows priced against the old step go fast
            row = max(0.0, seconds - step) / (rows - batch)
            old = self._row_s.get(batch)
            if old is not None:
                row = min(row, self.clip * max(old, self.prior * step / batch))
            self._ewma(self._row_s, batch, row, 0.5 if batch in self._drifting else None)
        self._since_verify[batch] = 0
        self._since_plain[batch] = self._since_plain.get(batch, 0) + 1

    def _interval(self, batch: int) -> int:
        return max(1, self.probe_every // 8) if batch in self._drifting else self.probe_every

    def probe(self, batch: int) -> CostProbe:
        """Whether the next decode step at `batch` should re-measure (call once per decode step; the
        step's `plain` / `verify` observation answers it)."""
        every = self._interval(batch)
        if self._since_plain.get(batch, 0) >= every:  # also the first baseline, if drafts began at once
            return CostProbe.PLAIN
        if batch in self._step_s and self._since_verify.get(batch, 0) >= every:
            return CostProbe.VERIFY
        return CostProbe.NONE

    def row_cost(self, batch: int) -> float:
        step, row = self._step_s.get(batch), self._row_s.get(batch)
        cost = self.prior * batch if step is None or row is None or step <= 0.0 else row * batch / step
        return min(1.0, max(1e-3, cost))

    def prior_cost(self, batch: int) -> float:
        """The row price before anything was measured (what a VERIFY probe drafts with)."""
        return min(1.0, max(1e-3, self.prior * batch))


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


def accept_sampled(draft: Sequence[int], choose: Callable[[int], int]) -> list[int]:
    """Sample-and-compare for a point-mass draft: `choose(j)` samples row j from its target distribution
    (rows as in `accept_greedy`); the draft is accepted while the samples equal it, and the first sample
    that differs (or the row after the whole draft) ends the run. Exact: each token is a sample of its
    position's distribution given the tokens before it, which is rejection sampling's law when the draft
    distribution is a point mass (accept x with probability p(x), else the residual p without x). And with
    position-keyed draws (torch_sampling.Draws) it is the very token a plain step would have sampled, so
    a seeded request's text does not depend on how many rows speculation verified."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        token = choose(j)
        out.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return out
