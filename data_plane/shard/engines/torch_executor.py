"""The torch engine's executor: runs a scheduler's plan on the model and reports the tokens.

    executor = Executor(runner, prefix, masks)   # a loaded LlamaRunner, the SlotPrefix or None, a MaskPrefetch
    executor.reserve(plan)                       # plan: scheduler.SchedulerOutput; its prefix hits referenced
    result = executor.execute(plan)
    result.tokens[i]                             # plan.rows[i]'s tokens: 0 (a chunk), 1, or accepted drafts + 1
    result.seconds                               # the pass and the token choice

`reserve` comes right after schedule(), before the engine finishes the sequences the plan reaped
(their blocks are stored, which may evict unreferenced ones: a hit counted by schedule() must be
referenced first). Then `execute`, in order: the plan's slot moves (already ordered so none
overwrites KV still to be moved), the admitted sequences' reserved prefixes copied in
(torch_prefix.SlotPrefix.load), one forward pass over
every row (`LlamaRunner.forward`: batched attention over slots 0..n-1 for a decode or verify step,
per sequence otherwise), with the constrained rows' grammar masks filled in a worker thread meanwhile
(token_masks.MaskPrefetch: they depend only on tokens already taken), then the token choice: one call to torch_sampling.sample for the rows that
sample, or the speculator's acceptance (speculation.accept_greedy / accept_sampled) for a verify step. The executor
holds no sequence state: the engine updates the sequences from the result (torch_output.py).
Called on the scheduler thread only.

A pipeline's batch queue (torch_engine's `_step_queued`) splits `execute` in two:

    pending = executor.submit(plan, microbatches=1)   # moves, prefix loads, stage 0's layers, sent on
    ...                                                # more plans submitted meanwhile (other sequences)
    result = executor.complete(pending)                # its rows back (oldest first), tokens chosen
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from data_plane.shard.engines.prompt_logprobs import split_prompt_logits
from data_plane.shard.engines.scheduler import SchedulerOutput
from data_plane.shard.engines.sequence import SeqState
from data_plane.shard.engines.token_masks import MaskPrefetch
from data_plane.shard.engines.torch_sampling import sample
from data_plane.shard.engines.torch_spec import Speculator

if TYPE_CHECKING:
    import torch

    from data_plane.shard.engines.llama_runner import LlamaRunner
    from data_plane.shard.engines.torch_prefix import SlotPrefix


@dataclass(frozen=True)
class StepResult:
    tokens: tuple[tuple[int, ...], ...] = ()
    """Per plan row: the tokens it produced (none for a prompt chunk that does not complete its prompt)."""
    seconds: float = 0.0
    """The forward pass and the token choice."""


def choose_tokens(logits: torch.Tensor, seqs: Sequence[SeqState]) -> list[int]:
    """One token per row of `logits` for the sequence of that row (its sampling params and its draw for
    the position sampled)."""
    return sample(logits, [s.req.params for s in seqs], [s.draw() for s in seqs],
                  [s.req.processor for s in seqs])


@dataclass(frozen=True)
class Pending:
    """A plan submitted through a pipeline, its rows not collected yet."""

    plan: SchedulerOutput
    tickets: list[Any]
    began: float


class Executor:
    def __init__(self, runner: LlamaRunner, prefix: SlotPrefix | None = None, masks: MaskPrefetch | None = None) -> None:
        self.runner = runner
        self.prefix = prefix
        self.masks = masks

    def reserve(self, plan: SchedulerOutput) -> None:
        """Reference the admitted sequences' prefix hits, right after schedule() counted them and before
        anything stores or inserts blocks (the engine's `_plan`)."""
        if self.prefix is not None:
            for seq in plan.admitted:
                seq.held = self.prefix.reserve(seq.block_hashes, seq.num_computed_tokens)

    def _prepare(self, plan: SchedulerOutput) -> None:
        """The plan's slot moves, then its admitted sequences' reserved prefixes copied in."""
        for move in plan.moves:
            self.runner.move_slot(move.src, move.dst, move.length)
        if self.prefix is not None:
            for seq in plan.admitted:
                self.prefix.load(seq.held, seq.slot, seq.req.trace)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self._prepare(plan)
        rows = plan.rows
        if not rows:
            return StepResult()
        t0 = time.monotonic()
        self._prefetch(plan)
        logits = self.runner.forward([(r.seq.slot, r.tokens, r.start) for r in rows], [r.num_logits for r in rows],
                                     batched=plan.is_decode)
        return self._choose(plan, logits, t0)

    def _prefetch(self, plan: SchedulerOutput) -> None:
        """Start filling the grammar masks `plan` samples with, in the worker, during its pass."""
        if self.masks is not None:
            self.masks.start([(proc, r.draft) for r in plan.rows
                              if r.samples and (proc := r.seq.req.processor) is not None and proc.constrains])

    def submit(self, plan: SchedulerOutput, microbatches: int | None = None) -> Pending:
        """`execute` up to the pipeline's hop: the moves, the prefixes, stage 0's layers sent on
        (in up to `microbatches` micro-batches; None: the pipeline's own count). `plan` has rows."""
        self._prepare(plan)
        t0 = time.monotonic()
        rows = plan.rows
        self._prefetch(plan)
        tickets = self.runner.submit([(r.seq.slot, r.tokens, r.start) for r in rows], [r.num_logits for r in rows],
                                     batched=plan.is_decode, microbatches=microbatches)
        return Pending(plan, tickets, t0)

    def complete(self, pending: Pending) -> StepResult:
        """The submitted plan's rows back from the last stage (plans complete in the order
        submitted), its tokens chosen; `seconds` from its submission (other plans' passes overlap it)."""
        return self._choose(pending.plan, self.runner.collect(pending.tickets), pending.began)

    def _choose(self, plan: SchedulerOutput, logits: torch.Tensor, t0: float) -> StepResult:
        rows = plan.rows
        if plan.is_verify:
            tokens = [tuple(t) for t in Speculator.accept(logits, rows)]
        else:
            logits = split_prompt_logits(rows, logits)  # a prompt-logprobs request's rows recorded, not sampled
            sampling = [r.seq for r in rows if r.samples]
            picked = iter(choose_tokens(logits, sampling)) if sampling else iter(())
            tokens = [(next(picked),) if r.samples else () for r in rows]
        return StepResult(tuple(tokens), time.monotonic() - t0)
