"""The torch engine's speculative decode step (n-gram drafts, verified in the batch's one pass).

    spec = Speculator(max_k=15, max_batch=4)     # EngineConfig(speculation="ngram") builds it
    if not spec.step(engine, engine._running):   # called from TorchEngine._decode_step
        ...                                      # nobody drafted: the plain decode step runs
        spec.observe_plain(batch, step_s)        # which prices the verify rows (VerifyCost)

Per step: every running sequence may propose the draft tokens expected to pay for their rows
(data_plane/shard/engines/speculation.py);
if at least one did, all running sequences go through one `spec_runner.verify` pass (rows:
last token + draft, 1..k+1 per sequence) instead of the plain decode. Each sequence then keeps
its accepted drafts plus one model token, its length moves past exactly those (rejected drafts'
KV is rolled back by not counting it), and the tokens go through the engine's normal emit path
one by one (EOS, stop strings, max_tokens and the context limit cut exactly where they would
without speculation), their text leaving as one stream output. Above `max_batch` running
sequences no one drafts (verification costs more than it saves there: docs/BENCHMARKS.md).
Runs on the scheduler thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol, Sequence

from data_plane.shard.engines.spec_runner import verify
from data_plane.shard.engines.speculation import (
    NgramIndex,
    SeqSpec,
    VerifyCost,
    accept_greedy,
    accept_sampled,
    target_probs,
)
from data_plane.shard.engines.torch_config import SeqState, StepListener
from data_plane.shard.engines.torch_sampling import sample

log = logging.getLogger(__name__)


class SpecEngine(Protocol):
    """What a speculative step uses of the engine (``TorchEngine`` has it all; declared here so this
    module never imports the engine that imports it)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def listener(self) -> StepListener: ...
    @property
    def _runner(self) -> Any: ...
    def _emit(self, seq: SeqState, token: int, held: str = "", send: bool = True) -> str: ...


class Speculator:
    def __init__(self, max_k: int = 15, max_batch: int = 4, miss_limit: int = 6, min_n: int = 1,
                 max_n: int = 4) -> None:
        self.max_k = max_k
        self.max_batch = max_batch
        self.miss_limit = miss_limit
        self.min_n = min_n
        self.max_n = max_n
        self.cost = VerifyCost()

    def observe_plain(self, batch: int, seconds: float) -> None:
        """A decode step where nobody drafted took `seconds` (the verify rows' cost is against it)."""
        self.cost.plain(batch, seconds)

    def _state(self, seq: SeqState) -> SeqSpec:
        if seq.spec is None:
            seq.spec = SeqSpec(max_k=self.max_k, miss_limit=self.miss_limit,
                               index=NgramIndex(self.min_n, self.max_n))
            seq.spec_ctx = list(seq.req.prompt_ids)
        return seq.spec

    def _draft(self, seq: SeqState, max_model_len: int, row_cost: float) -> tuple[list[int], bool]:
        """This step's draft for `seq` and whether it came from a one-token (weak) match."""
        if seq.req.processor is not None:
            return [], False  # processed/constrained sequences decode one token a step (no drafts)
        state = self._state(seq)
        ctx = seq.spec_ctx
        ctx.extend(seq.output_ids[len(ctx) - len(seq.req.prompt_ids):])
        found = state.index.match(ctx)
        weak = found is not None and found[0] < 2
        # Drafts may run up to max_tokens (the cap then lands inside an accepted draft and the rest
        # is dropped by the emit path), never to within 2 positions of the context limit.
        room = min(seq.max_tokens - len(seq.output_ids), max_model_len - seq.length - 3)
        k = min(state.draft_len(row_cost, weak), room)
        if found is None or k <= 0:
            return [], False
        return ctx[found[1] : found[1] + k], weak

    def step(self, eng: SpecEngine, batch: Sequence[SeqState]) -> bool:
        """One speculative decode step over `batch` (the running sequences, slots 0..n-1); False
        (nothing done) when no sequence has a draft or the batch is above `max_batch`."""
        if len(batch) > self.max_batch:
            return False
        row_cost = self.cost.row_cost(len(batch))
        drafted = [self._draft(s, eng.max_model_len, row_cost) for s in batch]
        drafts = [d for d, _ in drafted]
        if not any(drafts):
            return False
        t0 = time.monotonic()
        rows = [[s.last_token] + d for s, d in zip(batch, drafts)]
        starts = [s.length for s in batch]
        logits = verify(eng._runner, rows, starts)  # type: ignore[arg-type]  # set once loaded
        argmax = logits.argmax(dim=-1).tolist()
        results: list[list[int]] = []
        off = 0
        for seq, row, draft in zip(batch, rows, drafts):
            n = len(row)
            params = seq.req.params
            if seq.req.processor is not None:  # never drafts: its one row goes through the processing sampler
                results.append(sample(logits[off : off + 1], [params], [seq.generator], [seq.req.processor]))
            elif params.greedy:
                results.append(accept_greedy(draft, argmax[off : off + n]))
            else:
                results.append(accept_sampled(draft, target_probs(logits[off : off + n], params), seq.generator))
            off += n
        step_s = time.monotonic() - t0
        self.cost.verify(len(batch), off, step_s)
        eng.listener.on_step(len(batch), step_s, "decode")
        eng.listener.on_iteration_tokens(off)
        # Every length first: a sequence that finishes below moves the last slot's KV, which must
        # include that sequence's accepted rows.
        for seq, start, tokens in zip(batch, starts, results):
            seq.length = start + len(tokens)
        for seq, start, (draft, weak), tokens in zip(list(batch), starts, drafted, results):
            accepted = len(tokens) - 1
            if draft:
                self._state(seq).record(len(draft), accepted, weak)
                eng.listener.on_spec_draft(len(draft), accepted)
            held = ""
            for i, token in enumerate(tokens):
                seq.length = start + 1 + i
                eng.listener.on_token(step_s / len(tokens))
                held = eng._emit(seq, token, held, send=i == len(tokens) - 1)
                if seq.finished:
                    break
        return True
