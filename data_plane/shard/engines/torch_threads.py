"""Intra-op threads that follow the host: the engine measures its decode step at 1 and at N threads
and keeps the faster, again and again.

    tuner = ThreadTuner(max_threads=2, set_threads=torch.set_num_threads, on_change=listener.on_threads)
    tuner.start()                          # on the scheduler thread: 1 thread until N measures faster
    tuner.for_other()                      # before a prefill pass: the chosen count
    tuner.for_decode()                     # before a decode step: the chosen count, or the probed one
    tuner.observe(batch=4, seconds=0.031)  # after that decode step; may switch the thread count
    tuner.observe(1, 0.035, comparable=False)  # a verify pass: time toward the period, not a sample

Built by the torch engine (data_plane/shard/engines/torch_engine.py) when `EngineConfig.adaptive_threads`
is on and more than one thread is allowed; called on its scheduler thread only.

Why: when the engine has the cores to itself, N OpenMP threads make a decode step faster than one
(2 cores, bf16, batch 1: 23 against 35 ms a step; streamed through the shard 38 against 26 tok/s). When
another process takes a core, the same N threads collapse: every parallel region waits at its
barrier for a thread the kernel has descheduled (a step 0.3-0.9 s; streamed: 2.9 tok/s against 25 at
one thread). No fixed count is right on a host the shard shares with a gateway, a cache node or
another shard.

It starts at N when the host's other processes left N cores idle while the model loaded (`HostCpu`:
/proc/stat's busy time less this process's own), else at one thread, the count that cannot collapse;
a wrong start is corrected by the first probe (after a second of decode, or at once when steps
collapse). Starting at one thread on an idle host cost a short benchmark ~1.5x its TPOT (measured: the
bench's 4 requests x 64 tokens spent most of their decode before the first probe).

How: a *probe* runs `probe_steps` decode steps at the other count (after one warm-up step, which is
not counted) and compares their median step time with the current count's recent median at the same
batch size (a window per batch size, so arrivals and departures do not reset the evidence). The
other count wins only when it is faster by more than `margin` (hysteresis: no flapping on noise), and
fewer threads only when faster by more than `margin_down`: a wrong move down costs the cores' gain
for a probe period that doubles up to `max_period_s`, and a short probe at fewer threads right after
steps at every thread reads fast (the other cores are still awake: a 2-stage pipeline on a 2-core VM
probed 1 thread at 6.6-10.4 ms a pass where 1 thread steadily ran 8.5-10.6 ms, against 6.3-7.8 at 2);
a wrong move up is undone within `persist` steps once they collapse. Contention is no near call: a
collapsed step is several times slower, far past either margin.
Only decode steps are probed: prefill passes always run at the chosen count.

When: a probe starts once `period_s` seconds of decode have passed since the last one (time, not
steps: a collapsed step can take a second); the period doubles (up to `max_period_s`) each time the
probe keeps the count and resets when it switches. `persist` steps in a row slower than `collapse`
times the current median (contention arrived; one slow step is a GC pause) start a probe at once,
against those slow steps. A probe that beats the slow steps but not the current count's median from
before them is a burst or contention, and only the current count can tell: one step back at it
(`_recheck`) moves down if it collapses again, else keeps the count and its old window. Bursts are
common on a VM: the host steals one vCPU for a few steps, and every thread of a step waits for it at
a barrier (runs of three 40-60 ms steps against 10-13 ms, on a 2-vCPU Firecracker guest): moving down
on each cost a probe period at the slower count, and the period doubles when the move back's probe
lands in the next burst. A probe stops early when its warm-up step already collapsed or its first
counted step is twice as slow as the current median, and the next one waits at least its cost over
`overhead` (probes take at most 5 % of decode time). A change of batch size mid-probe cancels it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class HostCpu:
    """Cores the host's *other* processes kept busy since this object was made (Linux /proc/stat; None
    elsewhere): the start of a model load to its end is the sample."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        own = os.times()
        tick = os.sysconf("SC_CLK_TCK")
        return (time.monotonic(), (user + nice + system + irq + softirq + steal) / tick, own.user + own.system)

    def idle_for(self, threads: int) -> bool:
        """Whether the other processes left `threads` of the usable cores idle since this was made."""
        from data_plane.common.cores import usable_cores

        busy = self.others_busy()
        return busy is not None and busy + threads <= usable_cores() + 0.5

    def others_busy(self) -> float | None:
        end = self._read()
        if self._start is None or end is None or end[0] - self._start[0] < 0.2:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, end))
        return max(0.0, (busy - own) / wall)


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 on_change: Callable[[int, str], None] | None = None, *, probe_steps: int = 4,
                 period_s: float = 1.0, max_period_s: float = 64.0, margin: float = 0.15, margin_down: float = 0.30,
                 collapse: float = 3.0, window: int = 16, persist: int = 3, overhead: float = 0.05,
                 initial: int = 1, min_threads: int = 1) -> None:
        if not 1 <= min_threads < max_threads:
            raise ValueError("a thread tuner needs two thread counts to choose from")
        self.max_threads, self.min_threads = max_threads, min_threads
        self.set_threads = set_threads
        self.on_change = on_change or (lambda threads, reason: None)
        self.probe_steps = probe_steps
        self.base_period_s = self.period_s = period_s
        self.max_period_s = max_period_s
        self.margin, self.margin_down = margin, margin_down
        self.collapse = collapse
        self.persist = persist
        self.overhead = overhead
        self.threads = initial if initial in (min_threads, max_threads) else min_threads  # the chosen count
        self.switches = 0
        self._applied = 0  # the count set now
        self._window = window
        self._recent: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=self._window))
        self._slow: list[float] = []  # consecutive decode steps slower than `collapse` x the median
        self._before: list[float] | None = None  # the window a collapse replaced, while its probe runs
        self._recheck: tuple[int, float] | None = None  # a collapse's batch size, and its median before it
        self._since_probe_s = 0.0
        self._probe: list[float] | None = None  # counted step times at the other count
        self._probe_batch = -1
        self._probe_s = 0.0  # decode time spent in the probe under way
        self._warm = False

    @property
    def other(self) -> int:
        return self.min_threads if self.threads != self.min_threads else self.max_threads

    def start(self) -> None:
        self._apply(self.threads)
        self.on_change(self.threads, "start")

    def for_other(self) -> None:
        """Before a pass that is not a decode step: the chosen count."""
        self._apply(self.threads)

    def for_decode(self) -> None:
        """Before a decode step: the probed count while a probe runs, else the chosen one."""
        self._apply(self.other if self._probe is not None else self.threads)

    def _apply(self, n: int) -> None:
        if n != self._applied:
            self.set_threads(n)
            self._applied = n

    def observe(self, batch: int, seconds: float, comparable: bool = True) -> None:
        """The decode step of `batch` sequences just run (after `for_decode`) took `seconds`. A step
        that is not `comparable` (a speculative verify pass: more rows than sequences) counts toward
        the probe period and the probe's cost, never toward a verdict."""
        if not comparable:
            if self._probe is not None:
                self._probe_s += seconds
            else:
                self._since_probe_s += seconds
            return
        if self._probe is not None:
            if batch != self._probe_batch:
                self._end_probe(None, "")  # no verdict from two batch sizes
            else:
                self._probe_step(seconds)
            return
        recent = self._recent[batch]
        current = statistics.median(recent) if len(recent) >= 4 else None
        self._since_probe_s += seconds
        if self._recheck is not None:
            (at, before), self._recheck = self._recheck, None
            if at == batch and seconds > self.collapse * before:  # collapsed again: contention, not a burst
                self._switch(self.other, f"{1000 * seconds:.1f} ms a step again, {1000 * before:.1f} ms before")
                return
        if current is not None and seconds > self.collapse * current:
            # Kept out of the baseline until it persists (a GC pause is one slow step, contention is not);
            # then the slow steps are the baseline the probe must beat.
            self._slow.append(seconds)
            if len(self._slow) >= self.persist:
                self._before = list(recent)
                recent.clear()
                recent.extend(self._slow)
                self._slow.clear()
                self._start_probe(batch)
            return
        self._slow.clear()
        recent.append(seconds)
        if current is not None and self._since_probe_s >= self.period_s:
            self._start_probe(batch)

    def _start_probe(self, batch: int) -> None:
        self._probe = []
        self._probe_batch = batch
        self._probe_s = 0.0
        self._warm = False

    def _probe_step(self, seconds: float) -> None:
        assert self._probe is not None
        self._probe_s += seconds
        current = statistics.median(self._recent[self._probe_batch])  # >= `persist` samples when it began
        if not self._warm:  # the first step at a new count pays for waking its threads: not counted,
            self._warm = True  # unless it already collapsed
            if seconds > self.collapse * current:
                self._end_probe(False, "")
            return
        self._probe.append(seconds)
        if len(self._probe) == 1 and seconds > 2 * current:
            self._end_probe(False, "")
            return
        if len(self._probe) >= self.probe_steps:
            probe = statistics.median(self._probe)
            margin = self.margin_down if self.other < self.threads else self.margin
            faster: bool | None = probe < (1 - margin) * current
            before = self._before
            if faster and before and not probe < (1 - margin) * statistics.median(before):
                # Faster than the collapsed steps, not than this count before them: a burst on the host
                # (one vCPU stolen for a few steps) or contention? One step back at this count tells.
                self._recent[self._probe_batch].clear()
                self._recent[self._probe_batch].extend(before)
                self._recheck = (self._probe_batch, statistics.median(before))
                faster = None
            self._end_probe(faster, f"{1000 * probe:.1f} ms a step against {1000 * current:.1f} ms")

    def _end_probe(self, switch: bool | None, why: str) -> None:
        """Close the probe: switch to the probed count (True), keep the current one (False), or
        cancel it (None: no verdict, probe again after another period)."""
        self._probe = None
        self._before = None
        self._since_probe_s = 0.0
        if switch:
            self._switch(self.other, why)
        elif switch is False:
            self.period_s = min(self.max_period_s, self.period_s * 2)
        # Probing never costs more than `overhead` of decode time (a collapsed step can take a second).
        self.period_s = max(self.period_s, self._probe_s / self.overhead)

    def _switch(self, count: int, why: str) -> None:
        self.threads = count
        self.switches += 1
        self.period_s = self.base_period_s
        self._recent.clear()
        log.info("intra-op threads -> %d (%s)", count, why)
        self.on_change(count, "probe")
