"""The torch engine's scheduler on a fake executor, for tests: no weights, no clock, no threads.

    h = Harness(SchedulerConfig(max_num_seqs=8, prefill_chunk=256))
    h.add(make_seq("a", 100)); plan = h.step()      # schedule, check, execute (fake KV), update
    h.run()                                         # until nothing is left; returns the plans

The fake executor keeps a fake KV cache, one list per slot of (request id, position) entries,
written by the pass and copied by the plan's slot moves, so every step also checks that no move
loses or mixes a sequence's KV. Used by tests/data_plane/test_scheduler.py and
test_scheduler_in_flight.py (which wraps Harness in the engine's batch queue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from data_plane.shard.engines.base import GenerationRequest, SamplingParams, TextStream
from data_plane.shard.engines.scheduler import RowKind, Scheduler, SchedulerConfig, SchedulerOutput
from data_plane.shard.engines.sequence import SeqState, SeqStatus


def make_seq(rid: str, prompt_len: int, priority: int = 0, max_tokens: int = 4,
             deadline: float | None = None) -> SeqState:
    """A waiting sequence of `prompt_len` prompt tokens that ends after `max_tokens` tokens."""
    req = GenerationRequest(rid, [1 + (i % 50) for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens),
                            priority=priority, deadline=deadline)
    return SeqState(req=req, max_tokens=max_tokens, sink=lambda out: None, stream=TextStream(lambda ids: "", ()),
                    draws=None)


@dataclass
class FakeDrafter:
    """Drafts `k` tokens (7s) for every sequence it is asked for; counts its calls."""

    max_batch: int = 4
    k: int = 3
    calls: int = 0

    def draft(self, seqs, max_model_len):  # type: ignore[no-untyped-def]
        self.calls += 1
        return [([7] * self.k, 4) for _ in seqs]


@dataclass
class Harness:
    """A scheduler, a fake executor (fake KV per slot) and the engine's update step."""

    config: SchedulerConfig
    hits: dict[str, int] = field(default_factory=dict)
    drafter: FakeDrafter | None = None
    accept: int = 1  # draft tokens a verify row accepts
    now: float = 1000.0

    def __post_init__(self) -> None:
        self.sched = Scheduler(self.config, prefix=lambda s: self.hits.get(s.request_id, 0), drafter=self.drafter)
        self.kv: list[list[tuple[str, int]]] = [[] for _ in range(self.config.max_num_seqs)]
        self.seqs: dict[str, SeqState] = {}

    def add(self, seq: SeqState) -> SeqState:
        self.seqs[seq.request_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        plan = self.sched.schedule(self.now)
        self.check(plan)
        self.execute(plan)
        self.update(plan)
        return plan

    def execute(self, plan: SchedulerOutput) -> None:
        """The fake executor: slot moves, prefix loads and the pass's KV writes, each row checked to
        extend exactly what its slot holds."""
        for m in plan.moves:
            self.kv[m.dst] = list(self.kv[m.src][: m.length])
        for seq in plan.admitted:
            self.kv[seq.slot] = [(seq.request_id, p) for p in range(seq.num_computed_tokens)]
        for row in plan.rows:
            kv = self.kv[row.seq.slot]
            assert kv[: row.start] == [(row.seq.request_id, p) for p in range(row.start)], (row.seq.request_id, kv)
            self.kv[row.seq.slot] = kv[: row.start] + [(row.seq.request_id, row.start + i)
                                                       for i in range(len(row.tokens))]

    def update(self, plan: SchedulerOutput) -> None:
        """The engine's update: computed counts, sampled tokens (5; a verify row accepts `accept`
        draft tokens), finishes by length. A sequence finished meanwhile (aborted in flight) is skipped."""
        for row in plan.rows:
            seq = row.seq
            if seq.finished:
                continue
            if row.kind is RowKind.PREFILL:
                seq.num_computed_tokens += len(row.tokens)
                tokens = [5] if row.samples else []
            elif row.kind is RowKind.DECODE:
                tokens = [5]
            else:
                tokens = list(row.draft[: self.accept]) + [5]
            for i, tok in enumerate(tokens):
                if row.kind is not RowKind.PREFILL:
                    seq.num_computed_tokens = row.start + 1 + i
                seq.last_token = tok
                seq.output_ids.append(tok)
                if len(seq.output_ids) >= seq.max_tokens:
                    self.sched.finish(seq, SeqStatus.FINISHED_LENGTH)
                    break

    def check(self, plan: SchedulerOutput) -> None:
        holders = self.sched.holders
        slots = [s.slot for s in holders]
        assert len(set(slots)) == len(slots) and all(0 <= x < self.config.max_num_seqs for x in slots)
        assert [r.seq.slot for r in plan.rows] == sorted(r.seq.slot for r in plan.rows)
        if plan.is_decode:
            assert [r.seq.slot for r in plan.rows] == list(range(len(plan.rows)))
        assert plan.num_tokens - sum(1 + len(r.draft) for r in plan.rows if r.kind is not RowKind.PREFILL) \
            <= self.config.prefill_chunk + 1
        decoding = self.sched.decoding()
        assert [s.slot for s in decoding] == list(range(len(decoding)))

    def run(self, steps: int = 100) -> list[SchedulerOutput]:
        plans = []
        for _ in range(steps):
            plan = self.step()
            if not plan.rows and not self.sched.holders and not self.sched.num_waiting:
                break
            plans.append(plan)
        return plans
