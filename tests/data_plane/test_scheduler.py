"""The torch engine's scheduler on a fake executor: no weights, no clock, no threads (vLLM's
tests/v1/core/test_scheduler.py is the model). The fake executor keeps a fake KV cache, one list
per slot of (request id, position) entries, written by the pass and copied by the plan's slot
moves, so every test also checks that no move loses or mixes a sequence's KV (the harness:
tests/support/scheduler.py).

    .venv/bin/python -m pytest tests/data_plane/test_scheduler.py -q        # < 1 s
"""

from __future__ import annotations

import random

import pytest

from data_plane.shard.engines.scheduler import (
    RowKind,
    SchedulerConfig,
    SlotMove,
    order_moves,
)
from data_plane.shard.engines.sequence import SeqStatus
from tests.support.scheduler import FakeDrafter, Harness, make_seq


def ids(rows) -> list[tuple[str, str, int]]:  # type: ignore[no-untyped-def]
    return [(r.seq.request_id, r.kind.value, len(r.tokens)) for r in rows]


def test_whole_prompts_share_the_budget_and_the_rest_waits() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=8, prefill_chunk=256))
    for rid in "abc":
        h.add(make_seq(rid, 100))
    plan = h.step()
    assert ids(plan.rows) == [("a", "prefill", 100), ("b", "prefill", 100)]
    assert h.sched.num_waiting == 1 and [s.request_id for s in plan.admitted] == ["a", "b"]
    plan = h.step()  # one mixed pass: the two decode beside the third prompt, no separate decode pass
    assert ids(plan.rows) == [("a", "decode", 1), ("b", "decode", 1), ("c", "prefill", 100)]
    assert not plan.is_decode
    plan = h.step()
    assert plan.is_decode and [r.seq.slot for r in plan.rows] == [0, 1, 2]


def test_a_long_prompt_is_chunked_and_then_decodes() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=256))
    seq = h.add(make_seq("long", 600))
    sizes = [len(h.step().rows[0].tokens) for _ in range(3)]
    assert sizes == [256, 256, 88] and not seq.prefilling and len(seq.output_ids) == 1
    assert h.sched.chunked() is None and h.sched.decoding() == [seq]
    assert h.step().rows[0].kind is RowKind.DECODE


def test_priority_then_arrival_order() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=8, prefill_chunk=40))
    for rid, prio in (("free-1", 2), ("ent-1", 0), ("plus-1", 1), ("ent-2", 0)):
        h.add(make_seq(rid, 20, priority=prio))
    assert [r.seq.request_id for r in h.step().rows] == ["ent-1", "ent-2"]
    assert [r.seq.request_id for r in h.step().rows if r.kind is RowKind.PREFILL] == ["plus-1", "free-1"]


def test_the_slot_bound_holds() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=2, prefill_chunk=512))
    for rid in "abc":
        h.add(make_seq(rid, 10, max_tokens=3))
    assert len(h.step().rows) == 2 and h.sched.num_waiting == 1
    h.run()
    assert all(s.status is SeqStatus.FINISHED_LENGTH for s in h.seqs.values())


def test_a_short_higher_priority_prompt_goes_ahead_of_a_chunk() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64))
    h.add(make_seq("free", 300, priority=2))
    h.step()
    h.add(make_seq("ent", 40, priority=0))
    plan = h.step()
    assert ids(plan.rows) == [("ent", "prefill", 40), ("free", "prefill", 24)]
    assert plan.moves == (SlotMove("free", 0, 1, 64),) and plan.parked is None and plan.beside == 0
    plan = h.step()  # the chunk of a lower priority: the enterprise one decodes beside it
    assert ids(plan.rows) == [("ent", "decode", 1), ("free", "prefill", 64)] and not plan.decode_yield


def test_a_long_higher_priority_prompt_parks_the_chunk_and_it_resumes_where_it_stopped() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64))
    free = h.add(make_seq("free", 300, priority=2, max_tokens=2))
    h.step()
    h.add(make_seq("ent", 100, priority=0, max_tokens=2))
    plan = h.step()
    assert plan.parked is free and free.status is SeqStatus.PARKED and free.num_computed_tokens == 64
    assert ids(plan.rows) == [("ent", "prefill", 64)] and plan.moves == (SlotMove("free", 0, 1, 64),)
    assert h.sched.parked() == [free] and h.sched.chunked() is h.seqs["ent"]
    plan = h.step()
    assert ids(plan.rows) == [("ent", "prefill", 36)]  # its last chunk; free is still parked
    plan = h.step()  # free carries on in the slot after the decoding one, from token 64
    assert free.status is SeqStatus.RUNNING and ids(plan.rows) == [("ent", "decode", 1), ("free", "prefill", 64)]
    assert plan.rows[1].start == 64 and not plan.decode_yield and plan.moves == ()
    h.run()
    assert free.status is SeqStatus.FINISHED_LENGTH


def test_nested_parking_and_an_aborted_parked_prompt_close_up_the_slots() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=32))
    free = h.add(make_seq("free", 200, priority=2, max_tokens=2))
    h.step()
    plus = h.add(make_seq("plus", 200, priority=1, max_tokens=2))
    assert h.step().parked is free
    ent = h.add(make_seq("ent", 200, priority=0, max_tokens=2))
    assert h.step().parked is plus
    assert h.sched.parked() == [plus, free] and (ent.slot, plus.slot, free.slot) == (0, 1, 2)
    h.sched.abort("plus")
    plan = h.step()
    assert plan.finished == (plus,) and plus.status is SeqStatus.FINISHED_ABORTED
    assert free.slot == 1 and SlotMove("free", 2, 1, 32) in plan.moves
    h.run()
    assert free.status is ent.status is SeqStatus.FINISHED_LENGTH and not h.sched.holders


def test_same_priority_prompts_are_prefilled_beside_a_chunk() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64, beside_share=0.75))
    h.add(make_seq("long", 300, priority=1))
    h.step()
    h.add(make_seq("short", 37, priority=1))
    h.add(make_seq("long-b", 200, priority=1))
    plan = h.step()
    assert plan.beside == 1 and ids(plan.rows) == [("short", "prefill", 37), ("long", "prefill", 27)]
    assert h.step().beside == 0  # the second long one is too long for the share: it waits its turn
    assert h.sched.num_waiting == 1


def test_lower_priority_decodes_yield_to_a_higher_priority_chunk() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=32))
    h.add(make_seq("free", 10, priority=2, max_tokens=50))
    h.step()
    h.add(make_seq("ent", 100, priority=0))
    plans = [h.step() for _ in range(5)]  # 100 tokens: 4 chunks of at most 32
    assert all(p.decode_yield and ids(p.rows) == [("ent", "prefill", n)] for p, n in zip(plans, (32, 32, 32, 4)))
    assert ids(plans[4].rows) == [("free", "decode", 1), ("ent", "decode", 1)] and not plans[4].decode_yield


def test_drafts_only_in_pure_decode_steps_and_up_to_max_batch() -> None:
    drafter = FakeDrafter(max_batch=2, k=3)
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64), drafter=drafter, accept=2)
    a = h.add(make_seq("a", 10, max_tokens=20))
    h.step()
    assert drafter.calls == 0  # a prefill step drafts nothing
    plan = h.step()
    assert plan.is_verify and ids(plan.rows) == [("a", "verify", 4)] and plan.rows[0].draft == (7, 7, 7)
    assert a.num_computed_tokens == 10 + 3 and len(a.output_ids) == 4  # 2 accepted + the model's token
    h.add(make_seq("b", 10, max_tokens=20))
    calls = drafter.calls
    assert not h.step().is_verify and drafter.calls == calls  # mixed: b's prompt rides with a's decode
    assert h.step().is_verify
    h.add(make_seq("c", 10, max_tokens=20))
    h.step()
    calls = drafter.calls
    plan = h.step()
    assert plan.is_decode and not plan.is_verify and drafter.calls == calls  # 3 decoding > max_batch


def test_a_finished_sequence_s_slot_is_filled_by_the_last_one() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64))
    seqs = [h.add(make_seq(rid, 8, max_tokens=9)) for rid in "abcd"]
    h.step()
    h.step()
    h.sched.finish(seqs[1], SeqStatus.FINISHED_STOPPED)
    plan = h.step()
    assert plan.moves == (SlotMove("d", 3, 1, seqs[3].num_computed_tokens - 1),)
    assert [r.seq.request_id for r in plan.rows] == ["a", "d", "c"]


def test_aborts_and_deadlines() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=1, prefill_chunk=64))
    run = h.add(make_seq("run", 8, max_tokens=50))
    waits = h.add(make_seq("waits", 8))
    late = h.add(make_seq("late", 8, deadline=h.now + 5))
    h.step()
    h.sched.abort("waits")
    assert h.step().finished == (waits,)
    h.now += 10
    plan = h.step()
    assert plan.finished == (late,) and late.status is SeqStatus.FINISHED_ABORTED
    h.sched.abort("run")
    plan = h.step()
    assert plan.finished == (run,) and not plan.rows and not h.sched.holders


def test_a_deadline_abandons_waiting_work_but_never_cuts_a_running_stream() -> None:
    """The gateway's deadline is for work nobody waits for any more; a stream that runs past it (a long
    reply, or one resumed on this shard after a failover, which keeps the first attempt's deadline)
    ends by its length or its client's disconnect, not mid-reply with a finish reason OpenAI lacks."""
    h = Harness(SchedulerConfig(max_num_seqs=1, prefill_chunk=64))
    running = h.add(make_seq("running", 8, max_tokens=30, deadline=h.now + 5))
    waiting = h.add(make_seq("waiting", 8, deadline=h.now + 5))
    h.step()
    h.now += 10
    assert h.step().finished == (waiting,)
    h.run()
    assert running.status is SeqStatus.FINISHED_LENGTH and len(running.output_ids) == 30


def test_a_prefix_hit_counts_only_the_uncached_tokens() -> None:
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64), hits={"a": 96, "b": 32})
    h.add(make_seq("a", 100))
    h.add(make_seq("b", 90))
    plan = h.step()  # 4 + 58 uncached tokens fit the budget together
    assert [(r.seq.request_id, r.start, len(r.tokens)) for r in plan.rows] == [("a", 96, 4), ("b", 32, 58)]


def test_order_moves_vacates_destinations_first() -> None:
    up = [SlotMove("x", 3, 4, 1), SlotMove("y", 4, 5, 1)]
    assert order_moves(up) == up[::-1]
    with pytest.raises(RuntimeError):
        order_moves([SlotMove("x", 1, 2, 1), SlotMove("y", 2, 1, 1)])


@pytest.mark.parametrize("seed", range(30))
def test_random_traffic_keeps_every_invariant(seed: int) -> None:
    """Arrivals of every priority and length, prefix hits, aborts, finishes: the harness checks slots,
    row order, the budget and every sequence's KV after every move, and every request ends."""
    rnd = random.Random(seed)
    drafter = FakeDrafter(max_batch=3, k=2) if seed % 2 else None
    h = Harness(SchedulerConfig(max_num_seqs=rnd.choice([2, 3, 5]), prefill_chunk=rnd.choice([16, 48]),
                                beside_share=rnd.choice([0.0, 0.5])), drafter=drafter, accept=rnd.choice([0, 1, 2]))
    for i in range(200):
        if rnd.random() < 0.3:
            seq = h.add(make_seq(f"r{i}", rnd.choice([3, 12, 40, 90]), priority=rnd.randrange(3),
                                 max_tokens=rnd.randrange(1, 12)))
            if rnd.random() < 0.3:  # a prefix-cache hit (at least one token left to compute)
                h.hits[seq.request_id] = rnd.randrange(seq.num_prompt_tokens)
        if rnd.random() < 0.05 and h.seqs:
            h.sched.abort(rnd.choice(list(h.seqs)))
        h.step()
    h.run(1000)
    assert all(s.finished for s in h.seqs.values()) and not h.sched.holders and not h.sched.num_waiting


def test_the_speculator_re_measures_its_row_cost_on_a_fake_clock() -> None:
    """The real n-gram Speculator drafting for the scheduler, its steps timed by a fake clock
    (step = base + rows x row): a plain probe now and then while it speculates, and when the host
    slows (base x3) the row price follows within a few probes instead of keeping the first one."""
    from data_plane.shard.engines.speculation import CostProbe, VerifyCost
    from data_plane.shard.engines.torch_spec import Speculator

    probes: list[str] = []
    spec = Speculator(max_k=4, max_batch=4, on_probe=probes.append)
    spec.cost = VerifyCost(prior=0.02, probe_every=16)
    h = Harness(SchedulerConfig(max_num_seqs=4, prefill_chunk=64), drafter=spec, accept=1)  # type: ignore[arg-type]
    h.add(make_seq("a", 10, max_tokens=100_000))
    clock = {"base": 0.020, "row": 0.0004}

    def run(steps: int) -> list[bool]:
        kinds = []
        for _ in range(steps):
            plan = h.step()
            if not plan.is_decode:
                continue
            seconds = clock["base"] + (plan.num_tokens - len(plan.rows)) * clock["row"]
            if plan.is_verify:
                spec.observe_verify(len(plan.rows), plan.num_tokens, seconds)
            else:
                spec.observe_plain(len(plan.rows), seconds)
            kinds.append(plan.is_verify)
        return kinds

    kinds = run(120)
    assert sum(kinds) > 90  # it speculates ...
    assert 4 <= probes.count("plain") <= 8  # ... with a plain step every 16 to keep the baseline
    assert spec.cost.row_cost(1) == pytest.approx(0.0004 / 0.020, rel=0.01)
    clock["base"] = 0.060  # the host got busy: a step takes 3x, a row the same
    kinds = run(120)
    assert spec.cost.drifts >= 1 and spec.cost.probes[CostProbe.PLAIN] == probes.count("plain")
    # Re-measured: 0.4 ms of a 60 ms step (without probes no plain step is ever seen here, drafts
    # beginning at once, and the price stays the prior's 0.02; priced against the old 20 ms step,
    # rows would read (60 + 4 x 0.4 - 20) / 4 ms = 0.52 of a step and drafting would all but stop).
    assert spec.cost.row_cost(1) == pytest.approx(0.0004 / 0.060, rel=0.1)
    assert sum(kinds[-40:]) >= 36
