"""The adaptive intra-op thread count (data_plane/shard/engines/torch_threads.py), driven by step times.

The step times are given, not measured: what is tested is the decision rule (probe, hysteresis,
collapse detection, back-off, batch changes). The measured effect on this machine, a real shard
streaming with and without a busy core, is in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import pytest

from data_plane.shard.engines.torch_threads import ThreadTuner


class Host:
    """Step time as a function of the thread count set: `fast` per thread count while idle, or
    `busy` while another process holds a core (N threads then collapse)."""

    def __init__(self) -> None:
        self.threads = 0
        self.sets: list[int] = []
        self.changes: list[tuple[int, str]] = []
        self.busy = False

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def step_s(self) -> float:
        if self.busy:
            return {1: 0.036, 2: 0.300}[self.threads]
        return {1: 0.035, 2: 0.023}[self.threads]


def run(tuner: ThreadTuner, host: Host, steps: int, batch: int = 1) -> list[int]:
    """`steps` decode steps as the engine runs them; the thread count each one ran with."""
    seen = []
    for _ in range(steps):
        tuner.for_decode()
        seen.append(host.threads)
        tuner.observe(batch, host.step_s())
    return seen


def make(host: Host, **kw: float) -> ThreadTuner:
    t = ThreadTuner(2, host.set, lambda n, why: host.changes.append((n, why)), **kw)  # type: ignore[arg-type]
    t.start()
    return t


def test_an_idle_host_moves_to_every_thread_and_probes_less_and_less() -> None:
    host = Host()
    tuner = make(host)
    seen = run(tuner, host, 2000)
    assert seen[0] == 1 and seen.index(2) <= 40  # 1 thread (safe) until a second of decode, then 2
    assert tuner.threads == 2 and tuner.switches == 1
    assert seen[40:].count(1) < 0.03 * len(seen)  # later probes at 1 thread are a small share
    assert tuner.period_s > tuner.base_period_s  # each kept verdict doubles the period
    assert host.changes == [(1, "start"), (2, "probe")]


def test_contention_drops_to_one_thread_at_once_and_idle_brings_the_threads_back() -> None:
    host = Host()
    tuner = make(host)
    run(tuner, host, 100)
    assert tuner.threads == 2
    host.busy = True
    seen = run(tuner, host, 40)
    # three slow steps in a row start a probe of 1 thread (a warm-up step and the probed ones), then
    # 1 thread; one later probe of 2 threads (after a second) costs two slow steps
    assert seen.index(1) == 3 and tuner.threads == 1 and seen[-1] == 1 and seen.count(2) <= 5
    assert host.changes[-1] == (1, "probe")
    # still busy: probes of 2 threads stop after one counted step; nearly every step runs at 1
    seen = run(tuner, host, 3000)
    assert tuner.threads == 1 and seen.count(2) < 0.02 * len(seen)
    host.busy = False
    seen = run(tuner, host, 3000)
    assert tuner.threads == 2 and host.changes[-1] == (2, "probe")


def test_a_host_busy_from_the_start_is_left_within_seconds() -> None:
    host = Host()
    host.busy = True
    tuner = make(host)
    seen = run(tuner, host, 40)
    # 1 thread from the start; the probe of 2 threads stops at its collapsed warm-up step
    assert tuner.threads == 1 and tuner.switches == 0 and seen.count(2) <= 1


def test_prefill_runs_at_the_chosen_count_during_a_probe() -> None:
    host = Host()
    tuner = make(host, period_s=0.1)
    while host.threads != 2:  # until a probe of 2 threads runs
        run(tuner, host, 1)
    tuner.for_other()  # a prefill pass now
    assert host.threads == 1
    tuner.for_decode()  # the probe goes on with the next decode step
    assert host.threads == 2


def test_one_slow_step_is_not_contention() -> None:
    host = Host()
    tuner = make(host)
    run(tuner, host, 100)
    for _ in range(20):  # a GC pause now and then
        tuner.observe(1, 0.5)
        run(tuner, host, 30)
    assert tuner.threads == 2 and tuner.switches == 1  # the first probe's move to 2, nothing since


def test_a_small_difference_does_not_switch() -> None:
    host = Host()
    tuner = make(host)
    for _ in range(1000):  # 2 threads only 5 % faster: under the 15 % margin, no switch
        tuner.for_decode()
        tuner.observe(1, 0.0285 if host.threads == 2 else 0.0300)
    assert tuner.threads == 1 and tuner.switches == 0


def test_a_batch_change_cancels_a_probe() -> None:
    host = Host()
    tuner = make(host, period_s=0.1)
    while host.threads != 2:  # until a probe of 2 threads runs
        run(tuner, host, 1)
    run(tuner, host, 1, batch=5)  # another batch size: no verdict from mixed sizes
    tuner.for_decode()
    assert host.threads == 1 and tuner.threads == 1 and tuner.switches == 0


def test_one_thread_is_nothing_to_tune() -> None:
    with pytest.raises(ValueError):
        ThreadTuner(1, lambda n: None)
    with pytest.raises(ValueError):
        ThreadTuner(2, lambda n: None, min_threads=2)


def test_a_floor_above_one_thread_chooses_between_the_floor_and_every_thread() -> None:
    """A pipeline's pass alone in it (pipeline.AloneThreads): each stage's share (2 of 4 cores) or
    every core; a collapse drops to the share, never below it."""
    times = {2: 0.030, 4: 0.018}
    busy = {2: 0.031, 4: 0.400}
    sets: list[int] = []
    tuner = ThreadTuner(4, sets.append, min_threads=2, initial=4)
    tuner.start()
    assert sets == [4] and tuner.other == 2
    for table in (times, busy):
        for _ in range(60):
            tuner.for_decode()
            tuner.observe(1, table[sets[-1]])
        assert tuner.threads == (4 if table is times else 2)
    assert set(sets) == {2, 4}
    assert ThreadTuner(4, sets.append, min_threads=2, initial=1).threads == 2  # a count outside: the floor


def test_verify_passes_count_toward_the_period_but_never_decide() -> None:
    """Speculative verify passes (more rows than sequences, slower than a decode step) run beside
    plain steps: their time brings the probe on as decode time does, and no verdict uses them."""
    host = Host()
    tuner = make(host)
    seen = []
    for i in range(200):  # three verify passes to every plain step, each 1.5x a plain step
        tuner.for_decode()
        seen.append(host.threads)
        tuner.observe(1, host.step_s() * (1.5 if i % 4 else 1.0), comparable=i % 4 == 0)
    # A second of decode, most of it in verify passes, then the probe's plain steps at 2 threads.
    assert seen.index(2) <= 40 and tuner.threads == 2
    slow = ThreadTuner(2, lambda n: None)
    slow.start()
    for _ in range(8):
        slow.observe(1, 0.035)
    for _ in range(10):  # verify passes 3x slower than the plain median: not contention
        slow.observe(1, 0.105, comparable=False)
    assert slow._probe is None and slow._slow == []


def test_a_start_at_every_thread_on_a_host_that_turns_out_busy_drops_to_one_at_once() -> None:
    """`initial=N` (the host was idle while the model loaded: HostCpu) starts at N; contention then is
    caught by the collapse rule, as for a tuner that probed its way to N."""
    host = Host()
    tuner = make(host, initial=2)
    seen = run(tuner, host, 20)
    assert seen[0] == 2 and tuner.threads == 2 and host.changes == [(2, "start")]
    host.busy = True
    seen = run(tuner, host, 40)
    assert seen.index(1) == 3 and tuner.threads == 1


def test_host_cpu_counts_other_processes_not_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """(monotonic s, host busy CPU s, this process's CPU s) samples: others = (busy - own) / wall."""
    from data_plane.shard.engines.torch_threads import HostCpu

    samples = iter([(10.0, 100.0, 5.0), (12.0, 103.8, 7.0)])  # 2 s: 3.8 s busy, 2.0 s of them ours
    monkeypatch.setattr(HostCpu, "_read", staticmethod(lambda: next(samples)))
    assert HostCpu().others_busy() == pytest.approx(0.9)
    samples = iter([(10.0, 100.0, 5.0), (10.1, 100.1, 5.0)])  # too short a sample to say
    assert HostCpu().others_busy() is None
    monkeypatch.undo()
    sample = HostCpu._read()  # the real reader: a sample where /proc/stat exists, None elsewhere
    assert sample is None or (len(sample) == 3 and min(sample) >= 0)


def test_fewer_threads_need_the_larger_margin_to_win() -> None:
    """At every thread, a probe at one thread 20 % faster (a near call: noise, or a probe read while
    the other cores were still awake) keeps every thread; 40 % faster moves down."""
    host = Host()
    tuner = make(host, initial=2)
    for _ in range(1000):
        tuner.for_decode()
        tuner.observe(1, 0.024 if host.threads == 1 else 0.030)
    assert tuner.threads == 2 and tuner.switches == 0
    for _ in range(1000):
        tuner.for_decode()
        tuner.observe(1, 0.017 if host.threads == 1 else 0.030)
    assert tuner.threads == 1 and tuner.switches == 1


def test_a_burst_on_the_host_is_not_contention() -> None:
    """A VM's host steals a vCPU for a few steps now and then: every step at 2 threads collapses while
    it lasts, then runs as before. The probe at 1 thread beats the collapsed steps but not 2 threads'
    speed before them; the step back at 2 threads runs fast, so 2 threads stay (before: each burst
    moved the tuner to 1 thread for a probe period, 1.4x slower a step)."""
    host = Host()
    tuner = make(host, initial=2)
    run(tuner, host, 50)
    seen = []
    for _ in range(10):  # a 4-step burst, then ~2 s of normal steps
        for _ in range(4):
            tuner.for_decode()
            seen.append(host.threads)
            tuner.observe(1, host.step_s() * (6 if host.threads == 2 else 1))
        seen += run(tuner, host, 80)
    assert tuner.threads == 2 and tuner.switches == 0
    assert seen.count(1) <= 10 * 5  # each burst: one probe at 1 thread (a warm-up and 4 counted steps)
    assert host.changes == [(2, "start")]


def test_contention_is_confirmed_by_one_step_back() -> None:
    """Contention: the probe at 1 thread (36 ms) beats the collapsed steps (300 ms) but not 2 threads
    before them (23 ms); the one step back at 2 threads collapses again, and 1 thread is chosen then,
    without another probe."""
    host = Host()
    tuner = make(host, initial=2)
    run(tuner, host, 50)
    host.busy = True
    seen = run(tuner, host, 20)
    assert seen[:9] == [2, 2, 2, 1, 1, 1, 1, 1, 2] and set(seen[9:]) == {1}
    assert tuner.threads == 1 and host.changes == [(2, "start"), (1, "probe")]


def test_the_modelled_noisy_host_of_bench_tuner() -> None:
    """`switchboard bench tuner`'s host, 10 seeds of 12 s at 0.3 bursts a second: the tuner keeps
    within 5 % of 2 threads held (the rule before the step back: 0.93x, 15 % of steps at 1 thread),
    and under contention takes the 1-thread count's speed, not 2 threads' collapse."""
    import statistics

    from data_plane.bench.tuner_sim import Host, main, run

    def median(policy: str, rate: float, contention: bool = False) -> float:
        return statistics.median(run(policy, Host(seed, rate, 0.15, 12.0, 0.007, 0.010, contention), 12.0)[0]
                                 for seed in range(10))

    assert median("tuner", 0.3) >= 0.95 * median("held 2", 0.3)
    assert median("tuner", 0.0, contention=True) >= 10 * median("held 2", 0.0, contention=True)
    main(["--rates", "1", "--seeds", "2", "--seconds", "2"])  # the command's own path
