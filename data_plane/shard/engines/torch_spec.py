"""The torch engine's n-gram speculation: drafts for the scheduler, acceptance for the executor.

    spec = Speculator(max_k=15, max_batch=4)          # EngineConfig(speculation="ngram") builds it
    drafts = spec.draft(decoding, max_model_len)      # scheduler.py, in a pure decode step: [(draft, match n)]
    tokens = spec.accept(logits, rows)                # torch_executor.py, after the verify pass
    spec.observe_plain(batch, step_s)                 # a decode step nobody drafted in (prices the rows)
    spec.observe_verify(batch, rows, step_s)

The row price (speculation.VerifyCost) is re-measured as it goes: every 64 steps at a batch size
one step is of the kind not otherwise seen there (a plain step among verify steps, a verify
step with the prior's drafts among plain ones), and every 8 while the plain step's time drifts.

Per step: every decoding sequence may propose the draft tokens expected to pay for their rows
(data_plane/shard/engines/speculation.py); if at least one did, the scheduler plans a verify step:
all decoding sequences in one pass (rows: last token + draft, 1..k+1 per sequence) instead of the
plain decode. Each sequence then keeps its accepted drafts plus one model token; its computed count
moves past exactly those (rejected drafts' KV is rolled back by not counting it), and the tokens go
through the engine's normal emit path one by one (EOS, stop strings, max_tokens and the context
limit cut exactly where they would without speculation: torch_output.py). A constrained sequence
drafts too (vLLM's way): its draft is cut at the first token the grammar rejects (`check_draft`), each
verify row is masked by the grammar as of its position (`mask_draft`) and, once verified, the matcher is
rolled back to the accepted tokens (`settle`: data_plane/shard/engines/logits.py); sequences with
penalties, bias, EOS bans or logprobs decode one token a step. Above `max_batch`
decoding sequences no one drafts (verification costs more than it saves there: docs/BENCHMARKS.md).
Runs on the scheduler thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from data_plane.shard.engines.sequence import SeqState
from data_plane.shard.engines.speculation import (
    CostProbe,
    NgramIndex,
    SeqSpec,
    SharedEvidence,
    VerifyCost,
    accept_greedy,
    accept_sampled,
)
from data_plane.shard.engines.torch_sampling import sample, sample_row

if TYPE_CHECKING:
    import torch

    from data_plane.shard.engines.scheduler import ScheduledRow

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, max_k: int = 15, max_batch: int = 4, miss_limit: int = 6, min_n: int = 1,
                 max_n: int = 4, on_probe: Callable[[str], None] | None = None) -> None:
        self.max_k = max_k
        self.max_batch = max_batch
        self.miss_limit = miss_limit
        self.min_n = min_n
        self.max_n = max_n
        self.cost = VerifyCost()
        self.evidence = SharedEvidence(max_n)  # what earlier sequences' drafts taught: a new one's prior
        self.on_probe = on_probe  # a row-cost probe step ran ("plain" / "verify"): the shard's metric

    def observe_plain(self, batch: int, seconds: float) -> None:
        """A decode step where nobody drafted took `seconds` (the verify rows' cost is against it)."""
        self.cost.plain(batch, seconds)

    def observe_verify(self, batch: int, rows: int, seconds: float) -> None:
        self.cost.verify(batch, rows, seconds)

    def state(self, seq: SeqState) -> SeqSpec:
        if seq.spec is None:
            seq.spec = SeqSpec(max_k=self.max_k, miss_limit=self.miss_limit, evidence=self.evidence.prior(),
                               shared=self.evidence, index=NgramIndex(self.min_n, self.max_n))
            seq.spec_ctx = list(seq.req.prompt_ids)
        return seq.spec

    def draft(self, seqs: Sequence[SeqState], max_model_len: int) -> list[tuple[list[int], int]]:
        """This step's draft for each of `seqs` (the decoding sequences) and the length of the n-gram
        match it came from (its evidence bucket; 0: no draft); call once per decode step (back-off
        counts steps)."""
        probe = self.cost.probe(len(seqs))
        if probe is CostProbe.PLAIN:  # one plain step now and then keeps the row price's baseline current
            self._probed(probe)
            return [([], 0) for _ in seqs]
        row_cost = self.cost.prior_cost(len(seqs)) if probe is CostProbe.VERIFY else self.cost.row_cost(len(seqs))
        drafts = [self._draft(s, max_model_len, row_cost) for s in seqs]
        if probe is CostProbe.VERIFY and any(d for d, _ in drafts):
            self._probed(probe)
        return drafts

    def _probed(self, probe: CostProbe) -> None:
        self.cost.probes[probe] += 1
        if self.on_probe is not None:
            self.on_probe(probe.value)

    def _draft(self, seq: SeqState, max_model_len: int, row_cost: float) -> tuple[list[int], int]:
        proc = seq.req.processor
        if proc is not None and not proc.drafts:
            return [], 0  # penalties, bias, EOS bans, logprobs: one token a step (no drafts)
        state = self.state(seq)
        ctx = seq.spec_ctx
        ctx.extend(seq.output_ids[len(ctx) - len(seq.req.prompt_ids):])
        found = state.index.match(ctx)
        n = found[0] if found is not None else 0
        # Drafts may run up to max_tokens (the cap then lands inside an accepted draft and the rest
        # is dropped by the emit path), never to within 2 positions of the context limit.
        room = min(seq.max_tokens - len(seq.output_ids), max_model_len - seq.num_computed_tokens - 3)
        k = min(state.draft_len(row_cost, n), room)
        if found is None or k <= 0:
            return [], 0
        draft = ctx[found[1] : found[1] + k]
        if proc is not None:  # constrained: only what the grammar allows from here
            draft = proc.check_draft(draft)
        return draft, n

    @staticmethod
    def accept(logits: torch.Tensor, rows: Sequence[ScheduledRow]) -> list[list[int]]:
        """Each verify row's accepted drafts plus one model token, from the pass's logits (one row of
        logits per verified position, in order): greedy by argmax, sampled by rejection sampling
        by sampling each row with the draw of its position and comparing (speculation.accept_sampled)."""
        argmax = logits.argmax(dim=-1).tolist()
        out: list[list[int]] = []
        off = 0
        for row in rows:
            n, seq = len(row.tokens), row.seq
            proc = seq.req.processor
            if not row.draft:  # no draft: its one row is sampled as in a plain step (processing, generator)
                out.append(sample(logits[off : off + n], [seq.req.params], [seq.draw()], [proc]))
            elif proc is not None:  # a checked draft: each row masked by the grammar as of its position
                masked = logits[off : off + n].clone()
                proc.mask_draft(masked, row.draft)
                tokens = _accept(row.draft, masked, masked.argmax(dim=-1).tolist(), seq)
                proc.settle(len(row.draft), tokens)
                out.append(tokens)
            else:
                out.append(_accept(row.draft, logits[off : off + n], argmax[off : off + n], seq))
            off += n
        return out


def _accept(draft: Sequence[int], logits: torch.Tensor, argmax: Sequence[int], seq: SeqState) -> list[int]:
    if seq.req.params.greedy:
        return accept_greedy(draft, argmax)
    draws, params, pos = seq.draws, seq.req.params, seq.position
    return accept_sampled(draft, lambda j: sample_row(logits[j], params, draws.at(pos + j)))
