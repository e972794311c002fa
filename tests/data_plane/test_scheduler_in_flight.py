"""The scheduler's batches in flight (a pipeline's batch queue, vLLM v1's `step_with_batch_queue`)
on a fake executor: no weights, no clock, no threads.

    .venv/bin/python -m pytest tests/data_plane/test_scheduler_in_flight.py -q        # < 1 s

`Queue` is the engine's loop (torch_engine.TorchEngine._step_queued) around the scheduler harness
(tests/support/scheduler.py): a plan is *submitted* (its moves, prefix loads and pass written into
the fake KV cache) and *returned* later, oldest first (the update: computed counts, tokens,
finishes), with up to `batch_queue` plans in between. Every submission checks that no sequence is in two plans in
flight, that a plan beside others in flight moves no slot and computes no prompt token, and the
fake KV of every row it runs.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from data_plane.shard.engines.batch_queue import BatchQueue
from data_plane.shard.engines.scheduler import RowKind, Scheduler, SchedulerConfig, SchedulerOutput
from data_plane.shard.engines.sequence import SeqState, SeqStatus
from data_plane.shard.engines.torch_executor import StepResult
from tests.support.scheduler import FakeDrafter, Harness, make_seq


class Queue(Harness):
    """Harness with the plans' updates deferred until each returns (FIFO)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.queue: deque[SchedulerOutput] = deque()
        self.plans: list[SchedulerOutput] = []

    def submit(self) -> SchedulerOutput:
        beside = bool(self.queue)
        plan = self.sched.schedule(self.now)
        self.plans.append(plan)
        in_flight = [r.seq for p in self.queue for r in p.rows]
        assert not {id(r.seq) for r in plan.rows} & {id(s) for s in in_flight}, "a sequence in two plans in flight"
        assert not {id(s) for s in plan.finished} & {id(s) for s in in_flight}, "finished while in flight"
        if self.config.batch_queue > 1:
            assert set(self.sched.in_flight) == set(in_flight) | {r.seq for r in plan.rows}
        if beside:  # the layout stays put while plans are in flight
            assert not plan.moves and not plan.admitted and plan.parked is None
            assert all(r.kind is not RowKind.PREFILL for r in plan.rows)
        self._check_rows(plan)
        self.execute(plan)
        if plan.rows:
            self.queue.append(plan)
        return plan

    def _check_rows(self, plan: SchedulerOutput) -> None:
        slots = [r.seq.slot for r in plan.rows]
        assert slots == sorted(slots)
        if plan.is_decode:  # contiguous slots: the pass's attention stays batched
            assert slots == list(range(slots[0], slots[0] + len(slots)))
        assert plan.num_tokens - sum(1 + len(r.draft) for r in plan.rows if r.kind is not RowKind.PREFILL) \
            <= self.config.prefill_chunk + 1

    def give_back(self) -> SchedulerOutput:
        """The oldest plan's pass is back: the engine's update."""
        plan = self.queue.popleft()
        self.sched.returned(plan)
        self.update(plan)
        return plan

    def tick(self) -> SchedulerOutput | None:
        """One engine iteration: submit while the queue has room and a plan came; else give one back."""
        if len(self.queue) < self.config.batch_queue:
            plan = self.submit()
            if plan.rows:
                return plan
        if self.queue:
            self.give_back()
        return None

    def drain(self, steps: int = 2000) -> None:
        for _ in range(steps):
            self.tick()
            if not self.queue and not self.sched.holders and not self.sched.num_waiting:
                return
        raise AssertionError("did not drain")


def decoding(h: Queue, n: int, batch_queue: int = 2, max_tokens: int = 50) -> list[SeqState]:
    """`n` sequences decoding in slots 0..n-1, nothing in flight."""
    seqs = [h.add(make_seq(f"r{i}", 4, max_tokens=max_tokens)) for i in range(n)]
    while any(s.prefilling or s.slot < 0 for s in seqs) or h.queue:
        h.tick()
    return seqs


def rows(plan: SchedulerOutput) -> list[str]:
    return [r.seq.request_id for r in plan.rows]


def test_b_plans_of_contiguous_decoders_fill_the_queue_and_each_waits_for_its_return() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=8, batch_queue=2))
    decoding(h, 5)
    first = h.submit()
    assert rows(first) == ["r0", "r1", "r2"] and first.is_decode  # ceil(5 / 2)
    second = h.submit()
    assert rows(second) == ["r3", "r4"] and [r.seq.slot for r in second.rows] == [3, 4]
    assert not h.submit().rows  # every decoder in flight: nothing to plan
    h.give_back()
    assert rows(h.submit()) == ["r0", "r1", "r2"]  # beside the second, the first run again
    assert not h.submit().rows


def test_batch_queue_1_keeps_the_one_plan_at_a_time_scheduler() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=8, batch_queue=1))
    decoding(h, 5)
    plan = h.sched.schedule(h.now)
    assert rows(plan) == ["r0", "r1", "r2", "r3", "r4"] and not h.sched.in_flight
    assert rows(h.sched.schedule(h.now)) == rows(plan)  # nothing tracked: the engine waits itself


def test_the_prompt_budget_holds_and_no_prompt_token_is_planned_beside_a_plan_in_flight() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=8, prefill_chunk=32, batch_queue=3))
    decoding(h, 4)
    h.add(make_seq("long", 100))
    h.add(make_seq("short", 10))
    for _ in range(40):
        plan = h.tick()
        if plan is not None and not plan.is_decode:
            assert sum(len(r.tokens) for r in plan.rows if r.kind is RowKind.PREFILL) <= 32
    h.drain()
    assert all(s.finished for s in h.seqs.values())


def test_an_abort_of_a_sequence_in_flight_applies_when_it_returns() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=8, batch_queue=2))
    seqs = decoding(h, 4)
    assert rows(h.submit()) == ["r0", "r1"]  # in flight
    h.sched.abort("r0")
    h.sched.abort("r1")
    seqs[3].req.deadline = h.now - 1  # a deadline abandons only waiting work: r3 streams on
    second = h.submit()  # r2, r3: r0 and r1 stay, in flight
    assert rows(second) == ["r2", "r3"] and not second.finished
    assert not seqs[0].finished and not seqs[1].finished
    before = len(seqs[0].output_ids)
    h.give_back()  # the first plan is back: its tokens are taken, then both leave at the next plan
    assert not seqs[0].finished and len(seqs[0].output_ids) == before + 1
    plan = h.submit()
    assert {s.request_id for s in plan.finished} == {"r0", "r1"} and not plan.rows  # their slots: a hole
    assert seqs[0].status is SeqStatus.FINISHED_ABORTED and seqs[1].status is SeqStatus.FINISHED_ABORTED
    h.give_back()
    plan = h.submit()  # nothing in flight: the hole closes (the highest first) and half of them decode
    assert rows(plan) == ["r3"] and [(m.src, m.dst) for m in plan.moves] == [(3, 0), (2, 1)]


def test_an_abort_of_a_sequence_not_in_flight_applies_at_once() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=8, batch_queue=2))
    seqs = decoding(h, 4)
    h.submit()  # r0, r1 in flight
    h.sched.abort("r2")
    plan = h.submit()
    assert [s.request_id for s in plan.finished] == ["r2"] and seqs[2].finished
    assert not plan.rows  # r2's slot is a hole (r3 must move): the layout changes once r0, r1 are back
    h.give_back()
    plan = h.submit()
    assert [(m.src, m.dst) for m in plan.moves] == [(3, 2)] and rows(plan) == ["r0", "r1"]


def test_a_waiting_higher_priority_request_gets_the_next_full_plan() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=5, batch_queue=2))
    decoding(h, 4)
    h.submit()
    h.add(make_seq("low", 6, priority=5))
    h.add(make_seq("high", 6, priority=0))
    assert not h.submit().rows  # a free slot and a waiting request: no plan beside; wait for the return
    h.give_back()
    plan = h.submit()
    assert [s.request_id for s in plan.admitted] == ["high"]  # the one free slot, ahead of the earlier "low"
    assert rows(plan) == ["r0", "r1", "r2", "r3", "high"] and not plan.moves


def test_no_free_slot_keeps_the_decoders_overlapping_while_requests_wait() -> None:
    h = Queue(SchedulerConfig(max_num_seqs=4, batch_queue=2))
    decoding(h, 4)
    h.submit()
    h.add(make_seq("late", 6, priority=0))
    assert rows(h.submit()) == ["r2", "r3"]  # no slot for it: no reason to stop the overlap


def test_speculation_drafts_for_each_run_beside_the_others() -> None:
    drafter = FakeDrafter(max_batch=4, k=2)
    h = Queue(SchedulerConfig(max_num_seqs=8, batch_queue=2), drafter=drafter, accept=1)
    decoding(h, 4)
    first, second = h.submit(), h.submit()
    assert first.is_verify and second.is_verify and rows(second) == ["r2", "r3"]
    h.drain()


@pytest.mark.parametrize("seed", range(30))
def test_random_traffic_in_flight_keeps_every_invariant(seed: int) -> None:
    """Arrivals of every priority and length, prefix hits, aborts and deadlines (in flight or not),
    finishes, with 2..4 plans in flight: the harness checks after every plan that no sequence is
    in two plans in flight, the layout stays put beside them, the budget and every row's KV; every
    request ends."""
    rnd = random.Random(seed)
    drafter = FakeDrafter(max_batch=3, k=2) if seed % 2 else None
    h = Queue(SchedulerConfig(max_num_seqs=rnd.choice([2, 3, 5, 8]), prefill_chunk=rnd.choice([16, 48]),
                              beside_share=rnd.choice([0.0, 0.5]), batch_queue=rnd.choice([2, 3, 4])),
              drafter=drafter, accept=rnd.choice([0, 1, 2]))
    for i in range(300):
        if rnd.random() < 0.2:
            seq = h.add(make_seq(f"r{i}", rnd.choice([3, 12, 40, 90]), priority=rnd.randrange(3),
                                 max_tokens=rnd.randrange(1, 20)))
            if rnd.random() < 0.3:
                h.hits[seq.request_id] = rnd.randrange(seq.num_prompt_tokens)
        if rnd.random() < 0.04 and h.seqs:
            h.sched.abort(rnd.choice(list(h.seqs)))
        if rnd.random() < 0.02 and h.seqs:
            h.seqs[rnd.choice(list(h.seqs))].req.deadline = h.now - 1
        h.tick()
    h.drain()
    assert all(s.finished for s in h.seqs.values()) and not h.sched.in_flight


class FakeExecutor:
    """torch_executor.Executor's submit/complete, recording the order; every row decodes token 5."""

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def submit(self, plan: SchedulerOutput, microbatches: int | None = None) -> Any:
        self.log.append(("submit", tuple(rows(plan))))
        return SimpleNamespace(plan=plan, microbatches=microbatches)

    def complete(self, pending: Any) -> StepResult:
        self.log.append(("complete", tuple(rows(pending.plan))))
        return StepResult(tuple((5,) for _ in pending.plan.rows), 0.01)


class FakeOutput:
    """torch_output.OutputProcessor's part the batch queue calls: computed counts and finishes."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched

    def admit(self, plan: SchedulerOutput) -> None:
        pass

    def finish(self, seq: SeqState, reason: str) -> None:
        self.sched.finish(seq, SeqStatus.FINISHED_ABORTED)

    def update(self, plan: SchedulerOutput, result: StepResult) -> None:
        for row, tokens in zip(plan.rows, result.tokens):
            seq = row.seq
            seq.num_computed_tokens = row.start + len(row.tokens)
            seq.last_token = tokens[-1] if tokens else seq.last_token
            seq.output_ids += list(tokens)
            if len(seq.output_ids) >= seq.max_tokens:
                self.sched.finish(seq, SeqStatus.FINISHED_LENGTH)


def test_the_engine_loop_fills_the_queue_first_then_collects_the_oldest_and_drains() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, batch_queue=2))
    executor, observed = FakeExecutor(), []
    output, lock = FakeOutput(sched), threading.Lock()

    def plan() -> SchedulerOutput:  # the engine's _plan without a prefix cache or thread tuner
        with lock:
            out = sched.schedule(0.0)
        for seq in out.finished:
            output.finish(seq, "abort")
        return out

    queue = BatchQueue(plan, sched, executor, output, lock,  # type: ignore[arg-type]
                       lambda plan, s: observed.append(len(plan.rows)))
    seqs = [make_seq(f"r{i}", 4, max_tokens=3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    while queue.step():
        pass
    assert all(s.finished for s in seqs) and not sched.in_flight and not len(queue)
    assert executor.log[:6] == [("submit", ("r0", "r1", "r2", "r3")), ("complete", ("r0", "r1", "r2", "r3")),
                                ("submit", ("r0", "r1")), ("submit", ("r2", "r3")),  # both groups in flight
                                ("complete", ("r0", "r1")), ("submit", ("r0", "r1"))]  # the first sent again
    assert queue.sent_beside > 0 and observed[0] == 4  # only a pass nothing overlapped is a cost sample
    sched.add(extra := make_seq("x", 4, max_tokens=9))
    queue.step()
    queue.step()
    queue.drain()
    assert not len(queue) and not sched.in_flight and extra.num_computed_tokens > 0
