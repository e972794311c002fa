"""The torch engine's scheduler: each step planned as a value, under one prompt-token budget.

    sched = Scheduler(SchedulerConfig(max_num_seqs=16, prefill_chunk=256, beside_share=0.5,
                                      max_model_len=2048), prefix=lookup, drafter=speculator)
    sched.add(seq)                        # a request arrived (status WAITING)
    sched.abort("req-1")                  # dropped at the next schedule()
    plan = sched.schedule(now=time.time())    # a SchedulerOutput: rows, slot moves, admissions, ...
    ...                                   # the executor runs it; the engine updates the sequences
    sched.finish(seq, SeqStatus.FINISHED_STOPPED)   # its slot is freed (the next plan compacts)

It never touches the model or torch (its tests run without weights: tests/data_plane/test_scheduler.py).
vLLM v1's `Scheduler.schedule()` is the model: one place holds the policy and returns a
`SchedulerOutput`; a sequence has a `SeqStatus` and one `num_computed_tokens` (sequence.py). The
policy, in order, each step:

1. Aborted requests, and waiting ones past their deadline, leave (`finished`).
2. A chunked prefill that finished or left hands over to the most recently parked one.
3. Without a chunked prefill, waiting requests are taken by (priority, arrival) while slots allow
   and their uncached prompt tokens fit `prefill_chunk` together; a longer first one becomes the
   chunked prefill (`prefill_chunk` tokens a step). While one is chunked, strictly higher-priority
   prompts that fit go *ahead* of it in its step; a longer one *parks* it (slot and KV kept).
   Without either, prompts of the chunk's own priority that fit `beside_share` of the budget are
   prefilled *beside* it (the chunk keeps the rest: it still progresses every step).
4. Rows: every decoding sequence's last token (unless a chunk of strictly higher priority than all
   of them is under way: they *yield* the step), the admitted prompts, the chunk. A step with
   prompt rows is one mixed pass and drafts nothing; a pure decode step asks the drafter for
   n-gram drafts (at most `Drafter.max_batch` sequences) and becomes a verify step when any came.
   Jump-forward (`jump_forward`, speculation on or off): a constrained sequence whose grammar forces
   the next tokens (llguidance's `compute_ff_tokens`, logits.RequestLogits.forced) drafts those, at any
   batch size, so the forced run is verified in one pass instead of one decode step a token (SGLang's
   jump-forward; the verify pass keeps the text exactly what one token a step would give).
5. Slots: decoding sequences hold 0..n-1 (a verify/decode pass attends over a view of the cache),
   then the admitted prompts, the chunk, the parked ones (most recently parked first). `_place`
   is the one place that keeps this: a freed slot is filled by the highest decoding one, the rest
   shift; the moves come ordered so that none overwrites KV still to be moved.

Batches in flight (`batch_queue` B > 1: a pipeline's batch queue, vLLM v1's
`step_with_batch_queue`; the engine calls `returned(plan)` when a plan's pass is back): a plan's
sequences are *in flight* until then, and vLLM's rule holds: a sequence in flight is in no other
plan (its computed count and last token are not known yet). A pure decode plan takes the first
ceil(d/B) of the d decoding sequences, so B plans of contiguous slot runs fill the pipeline.
While any plan is in flight `schedule()` only plans the next such run of decoding sequences not
in flight, and only when the layout stays put: no slot moves, no admissions, no prompt rows, no
parking; a sequence in flight is never moved, parked or finished. Whatever needs the layout to
change (a waiting request and a free slot, a hole left by a finished sequence, a prompt or chunk
under way) gets an empty plan, on which the engine waits for the oldest plan in flight; once none
is, the full policy above runs. The abort of a sequence in flight applies at the first `schedule()`
after it returned.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from data_plane.shard.engines.sequence import SeqState, SeqStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    """KV slots: sequences that hold one (decoding, prefilling or parked), 1..256."""
    prefill_chunk: int = 256
    """Prompt tokens a step may compute (the token budget; decode and draft rows ride beside it)."""
    beside_share: float = 0.5
    """Share of the budget, 0..0.9, that prompts of a chunked prefill's priority may take beside it."""
    max_model_len: int = 2048
    """Context window: drafts stop short of it."""
    jump_forward: bool = True
    """Constrained sequences draft the tokens their grammar forces (at most `max_forced` a step)."""
    max_forced: int = 16
    batch_queue: int = 1
    """Plans in flight at once, 1..64 (a pipeline's batch queue); 1: each plan returns before the next."""


class PrefixLookup(Protocol):
    """Prompt tokens whose KV the prefix cache holds for `seq` (at least one left to compute)."""

    def __call__(self, seq: SeqState) -> int: ...


class Drafter(Protocol):
    """Speculative drafts for the decoding sequences (torch_spec.Speculator)."""

    max_batch: int
    """No drafting while more sequences than this decode."""

    def draft(self, seqs: Sequence[SeqState], max_model_len: int) -> list[tuple[list[int], int]]:
        """(draft tokens, the length of the n-gram match they came from) per sequence, called once
        per decode step."""
        ...


class RowKind(enum.Enum):
    PREFILL = "prefill"  # prompt tokens: a whole prompt's uncached part or a chunk of it
    DECODE = "decode"  # the last sampled token
    VERIFY = "verify"  # the last sampled token and a draft (possibly empty) in a verify pass


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's input tokens in the step's pass, at positions start.."""

    seq: SeqState
    kind: RowKind
    start: int
    tokens: tuple[int, ...]
    draft: tuple[int, ...] = ()
    match_n: int = 0  # the n-gram match the draft came from (its acceptance evidence); 0: none, or forced

    @property
    def samples(self) -> bool:
        """A token is sampled from this row (a prefill row: only when it completes the prompt)."""
        return self.kind is not RowKind.PREFILL or self.start + len(self.tokens) >= self.seq.num_prompt_tokens

    @property
    def num_logits(self) -> int:
        """Rows of logits the step needs from it: every verified position, every prompt position of a request
        asking prompt logprobs (prompt_logprobs.py), else the last or none."""
        if self.kind is RowKind.VERIFY or (self.kind is RowKind.PREFILL
                                           and self.seq.req.params.prompt_logprobs is not None):
            return len(self.tokens)
        return int(self.samples)


@dataclass(frozen=True)
class SlotMove:
    """Copy the first `length` KV positions of slot `src` to slot `dst` (before the pass)."""

    request_id: str
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...] = ()
    """The pass, in slot order (decode/verify steps: slots 0..n-1)."""
    moves: tuple[SlotMove, ...] = ()
    """Applied first, in this order."""
    admitted: tuple[SeqState, ...] = ()
    """Left the queue this step; their cached prefix (`num_computed_tokens`) is loaded after the moves."""
    finished: tuple[SeqState, ...] = ()
    """Aborted or past their deadline (out of the slots; their KV still in place for the prefix cache)."""
    parked: SeqState | None = None
    """The chunked prefill preempted this step by a longer higher-priority prompt."""
    decode_yield: bool = False
    """The decoding sequences sit this step out for a higher-priority chunked prefill."""
    beside: int = 0
    """Prompts prefilled beside a chunked prefill of their priority."""

    @property
    def is_decode(self) -> bool:
        """A decode or verify step: no prompt rows (attention batched over slots 0..n-1)."""
        return bool(self.rows) and all(r.kind is not RowKind.PREFILL for r in self.rows)

    @property
    def is_verify(self) -> bool:
        return bool(self.rows) and self.rows[0].kind is RowKind.VERIFY

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


def order_moves(moves: list[SlotMove]) -> list[SlotMove]:
    """`moves` ordered so that each one's destination is vacated before it runs (no cycles arise
    from `_place`; one would be a bug, raised)."""
    pending, out = list(moves), []
    while pending:
        srcs = {m.src for m in pending}
        ready = [m for m in pending if m.dst not in srcs or m.dst == m.src]
        if not ready:
            raise RuntimeError(f"slot moves form a cycle: {pending}")
        for m in ready:
            pending.remove(m)
        out.extend(sorted(ready, key=lambda m: m.dst))
    return out


class Scheduler:
    def __init__(self, config: SchedulerConfig, prefix: PrefixLookup | None = None,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.prefix = prefix
        self.drafter = drafter
        self._waiting: list[tuple[int, int, SeqState]] = []
        self._order = itertools.count()
        self._holders: list[SeqState] = []  # sequences holding a slot (RUNNING or PARKED)
        self._aborts: set[str] = set()
        self._in_flight: set[SeqState] = set()  # in a plan not returned yet (batch_queue > 1)

    # -- requests in and out -------------------------------------------------------------------

    def add(self, seq: SeqState) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, next(self._order), seq))

    def abort(self, request_id: str) -> None:
        """Drop the request at the next schedule() (waiting or holding a slot)."""
        self._aborts.add(request_id)

    def returned(self, plan: SchedulerOutput) -> None:
        """`plan`'s pass is back (batch_queue > 1): its sequences may be planned, moved or finished again."""
        self._in_flight.difference_update(r.seq for r in plan.rows)

    def finish(self, seq: SeqState, status: SeqStatus) -> None:
        """`seq` ended (the engine saw EOS, a stop string, its length cap): its slot is free from
        the next plan on (`seq.slot` keeps the number until then, for the prefix cache)."""
        seq.status = status
        if seq in self._holders:
            self._holders.remove(seq)

    # -- what the engine and its tests read -----------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def holders(self) -> list[SeqState]:
        return list(self._holders)

    @property
    def in_flight(self) -> frozenset[SeqState]:
        """Sequences in a plan not returned yet (always empty with batch_queue 1)."""
        return frozenset(self._in_flight)

    def decoding(self) -> list[SeqState]:
        """RUNNING sequences past their prompt, in slot order."""
        return sorted((s for s in self._holders if s.status is SeqStatus.RUNNING and not s.prefilling),
                      key=lambda s: s.slot)

    def chunked(self) -> SeqState | None:
        """The chunked prefill: the RUNNING sequence still in its prompt (between steps there is at
        most one; during a step the prompts admitted whole sit in the slots below it)."""
        pre = [s for s in self._holders if s.status is SeqStatus.RUNNING and s.prefilling]
        return max(pre, key=lambda s: s.slot) if pre else None

    def parked(self) -> list[SeqState]:
        """PARKED sequences, most recently parked first (their slot order)."""
        return sorted((s for s in self._holders if s.status is SeqStatus.PARKED), key=lambda s: s.slot)

    # -- the plan ---------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step; `now` is Unix time, for deadlines. With batch_queue > 1 its sequences are
        in flight until `returned(plan)`."""
        plan = self._schedule_beside(now) if self._in_flight else self._schedule(now)
        if self.config.batch_queue > 1:
            self._in_flight.update(r.seq for r in plan.rows)
        return plan

    def _group(self, decoding: int) -> int:
        """Decoding sequences in one pure decode plan: all of them, or 1/B of them with B plans in flight."""
        return -(-decoding // self.config.batch_queue)

    def _schedule_beside(self, now: float) -> SchedulerOutput:
        """A plan beside those in flight: the first contiguous run (at most `_group`) of decoding
        sequences not in flight, or nothing when the layout must change first (module docstring)."""
        finished = self._reap(now)
        decoding = self.decoding()
        if (any(s.prefilling or s.status is SeqStatus.PARKED for s in self._holders)
                or (self._waiting and len(self._holders) < self.config.max_num_seqs)
                or [s.slot for s in decoding] != list(range(len(decoding)))):
            return SchedulerOutput(finished=tuple(finished))
        run: list[SeqState] = []
        for s in decoding:
            if s in self._in_flight:
                if run:
                    break
                continue
            run.append(s)
            if len(run) == self._group(len(decoding)):
                break
        rows = self._rows(run, [], None, self.config.prefill_chunk) if run else []
        return SchedulerOutput(rows=tuple(rows), finished=tuple(finished))

    def _schedule(self, now: float) -> SchedulerOutput:
        """The full policy (nothing in flight)."""
        finished = self._reap(now)
        chunk = self.chunked()
        if chunk is None and self.parked():
            chunk = self.parked()[0]  # the most recently parked carries on where it stopped
            chunk.status = SeqStatus.RUNNING
        hits: dict[int, int] = {}
        budget = self.config.prefill_chunk
        parked: SeqState | None = None
        beside = 0
        if chunk is None:
            new, chunk = self._admit(budget, hits)
        else:
            prio = chunk.priority
            new = self._take_head(lambda p: p < prio, budget, hits)
            if not new:
                taken = self._preempt(chunk, hits)
                if taken is not None:
                    parked, chunk = chunk, taken
        if chunk is not None and not new:
            prio = chunk.priority
            new = self._take_head(lambda p: p == prio, int(budget * self.config.beside_share), hits)
            beside = len(new)
        admitted = new + ([chunk] if chunk is not None and chunk.slot < 0 else [])
        decoding = self.decoding()
        moves = self._place(decoding, new, chunk)
        decoding.sort(key=lambda s: s.slot)
        decode_yield = chunk is not None and bool(decoding) and all(s.priority > chunk.priority for s in decoding)
        if chunk is None and not new:  # a pure decode plan: 1/B of the decoding ones with B in flight
            decoding = decoding[: self._group(len(decoding))]
        rows = self._rows(decoding if not decode_yield else [], new, chunk, budget)
        if parked is not None and chunk is not None:
            log.info("chunked prefill of priority %d parked for one of priority %d (%d prompt tokens)",
                     parked.priority, chunk.priority, chunk.num_prompt_tokens)
        if beside and chunk is not None:
            log.debug("%d prompt(s) of priority %d prefilled beside a chunked one (%d of its %d tokens left)",
                      beside, chunk.priority, chunk.num_prompt_tokens - chunk.num_computed_tokens,
                      chunk.num_prompt_tokens)
        return SchedulerOutput(rows=tuple(rows), moves=tuple(moves), admitted=tuple(admitted),
                               finished=tuple(finished), parked=parked, decode_yield=decode_yield, beside=beside)

    def _reap(self, now: float) -> list[SeqState]:
        aborts, self._aborts = self._aborts, set()
        gone = [s for _, _, s in self._waiting
                if s.request_id in aborts or (s.req.deadline is not None and s.req.deadline < now)]
        if gone:
            self._waiting = [e for e in self._waiting if e[2] not in gone]
            heapq.heapify(self._waiting)
        # A deadline abandons waiting work only: a sequence holding a slot has streamed or is about to,
        # and its client's disconnect (an abort) or its length ends it, never the clock.
        held = [s for s in self._holders if s.request_id in aborts]
        # A sequence in flight leaves when its pass is back (its abort kept until then).
        self._aborts |= {s.request_id for s in held if s in self._in_flight}
        gone += [s for s in held if s not in self._in_flight]
        for seq in gone:
            self.finish(seq, SeqStatus.FINISHED_ABORTED)
        return gone

    def _uncached(self, seq: SeqState, hits: dict[int, int]) -> int:
        if id(seq) not in hits:
            hits[id(seq)] = self.prefix(seq) if self.prefix is not None else 0
        return seq.num_prompt_tokens - hits[id(seq)]

    def _pop(self, hits: dict[int, int]) -> SeqState:
        seq = heapq.heappop(self._waiting)[2]
        seq.status = SeqStatus.RUNNING
        seq.num_computed_tokens = hits.get(id(seq), 0)
        seq.slot = -1
        self._holders.append(seq)
        return seq

    def _admit(self, budget: int, hits: dict[int, int]) -> tuple[list[SeqState], SeqState | None]:
        """No chunked prefill: whole prompts that fit `budget` together, or (as the first pick) one
        longer prompt that becomes the chunked prefill."""
        new: list[SeqState] = []
        used = 0
        running = len(self._holders)
        while self._waiting and running + len(new) < self.config.max_num_seqs:
            n = self._uncached(self._waiting[0][2], hits)
            if used + n > budget:
                return new, (self._pop(hits) if not new else None)
            new.append(self._pop(hits))
            used += n
        return new, None

    def _take_head(self, accept: Callable[[int], bool], budget: int, hits: dict[int, int]) -> list[SeqState]:
        """Whole prompts from the head of the queue while `accept(priority)`, a free slot and `budget`
        (their uncached tokens together) allow."""
        new: list[SeqState] = []
        used = 0
        while (self._waiting and accept(self._waiting[0][2].priority)
               and len(self._holders) + 1 <= self.config.max_num_seqs):
            n = self._uncached(self._waiting[0][2], hits)
            if used + n > budget:
                break
            new.append(self._pop(hits))
            used += n
        return new

    def _preempt(self, chunk: SeqState, hits: dict[int, int]) -> SeqState | None:
        """Park `chunk` for a waiting prompt of strictly higher priority (too long to go ahead of
        it in this step) when a slot is free; return that prompt (the chunked prefill now)."""
        if not self._waiting or len(self._holders) + 1 > self.config.max_num_seqs:
            return None
        if self._waiting[0][2].priority >= chunk.priority:
            return None
        self._uncached(self._waiting[0][2], hits)
        chunk.status = SeqStatus.PARKED
        return self._pop(hits)

    def _place(self, decoding: list[SeqState], new: list[SeqState], chunk: SeqState | None) -> list[SlotMove]:
        """Give every holder its slot (the module docstring's layout); return the KV moves, ordered."""
        d = len(decoding)
        kept = {s.slot for s in decoding if 0 <= s.slot < d}
        holes = [i for i in range(d) if i not in kept]
        movers = sorted((s for s in decoding if not 0 <= s.slot < d), key=lambda s: -s.slot)
        target = {id(s): h for s, h in zip(movers, holes)}
        pending = list(new) + ([chunk] if chunk is not None else []) + self.parked()
        target.update({id(s): d + i for i, s in enumerate(pending)})
        moves = []
        for seq in movers + pending:
            dst = target[id(seq)]
            if seq.slot >= 0 and seq.slot != dst and seq.num_computed_tokens > 0:
                moves.append(SlotMove(seq.request_id, seq.slot, dst, seq.num_computed_tokens))
            seq.slot = dst
        return order_moves(moves)

    def _forced(self, seq: SeqState) -> tuple[list[int], int] | None:
        """The tokens `seq`'s grammar forces next, as a (strong) draft, or None."""
        proc = seq.req.processor
        if proc is None:
            return None
        room = min(seq.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_computed_tokens - 3,
                   self.config.max_forced)
        forced = proc.forced(room) if room > 0 else []
        return (forced, 0) if forced else None

    def _rows(self, decoding: list[SeqState], new: list[SeqState], chunk: SeqState | None,
              budget: int) -> list[ScheduledRow]:
        rows = []
        if chunk is None and not new and decoding:
            drafts: list[tuple[list[int], int]] = [([], 0)] * len(decoding)
            if self.drafter is not None and len(decoding) <= self.drafter.max_batch:
                drafts = self.drafter.draft(decoding, self.max_model_len)
            if self.config.jump_forward:
                drafts = [self._forced(s) or d for s, d in zip(decoding, drafts)]
            if any(d for d, _ in drafts):
                return [ScheduledRow(s, RowKind.VERIFY, s.num_computed_tokens, (s.last_token, *d), tuple(d), n)
                        for s, (d, n) in zip(decoding, drafts)]
        for s in decoding:
            rows.append(ScheduledRow(s, RowKind.DECODE, s.num_computed_tokens, (s.last_token,)))
        used = 0
        for s in new:
            c = s.num_computed_tokens
            rows.append(ScheduledRow(s, RowKind.PREFILL, c, tuple(s.req.prompt_ids[c:])))
            used += s.num_prompt_tokens - c
        if chunk is not None:
            c = chunk.num_computed_tokens
            rows.append(ScheduledRow(chunk, RowKind.PREFILL, c, tuple(chunk.req.prompt_ids[c : c + max(1, budget - used)])))
        return rows
