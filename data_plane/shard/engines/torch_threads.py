"""Intra-op threads that follow the host: the engine measures its decode step at 1 and at N threads
and keeps the faster, again and again.

    tuner = ThreadTuner(max_threads=2, set_threads=torch.set_num_threads, on_change=listener.on_threads)
    tuner.start()                          # on the scheduler thread: N threads
    tuner.observe(batch=4, seconds=0.031)  # after every decode step; may switch the thread count

Built by the torch engine (data_plane/shard/engines/torch_engine.py) when `EngineConfig.adaptive_threads`
is on and more than one thread is allowed; called on its scheduler thread only.

Why: when the engine has the cores to itself, N OpenMP threads make a decode step faster than one
(2 cores, bf16, batch 1: 23 against 35 ms a step; streamed through the shard 38 against 26 tok/s). When
another process takes a core, the same N threads collapse: every parallel region waits at its
barrier for a thread the kernel has descheduled (streamed: 2.9 tok/s against 25 at one thread). No
fixed count is right on a host the shard shares with a gateway, a cache node or another shard.

How: a *probe* runs `probe_steps` decode steps at the other count (after one warm-up step, which is
not counted) and compares their median step time with the current count's recent median at the same
batch size. The other count wins only when it is faster by more than `margin` (hysteresis: no
flapping on noise). A probe starts every `period` decode steps; the period doubles (up to
`max_period`) each time the probe keeps the count, and resets when it switches. `persist` steps in a
row slower than `collapse` times the current median (contention arrived; one slow step is a GC pause)
start a probe at once, against those slow steps. A probe whose first
counted step is already twice as slow as the current median stops there (it costs one slow step, not
`probe_steps`). A change of batch size mid-probe cancels it (step times are only compared at one size).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 on_change: Callable[[int, str], None] | None = None, *, probe_steps: int = 4,
                 period: int = 64, max_period: int = 2048, margin: float = 0.15, collapse: float = 3.0,
                 window: int = 16, persist: int = 3) -> None:
        if max_threads < 2:
            raise ValueError("a thread tuner needs at least 2 threads to choose from")
        self.max_threads = max_threads
        self.set_threads = set_threads
        self.on_change = on_change or (lambda threads, reason: None)
        self.probe_steps = probe_steps
        self.base_period = self.period = period
        self.max_period = max_period
        self.margin = margin
        self.collapse = collapse
        self.persist = persist
        self._slow: list[float] = []  # consecutive steps slower than `collapse` x the median
        self.threads = max_threads
        self.switches = 0
        self._recent: deque[float] = deque(maxlen=window)  # step seconds at the current count, this batch
        self._batch = -1
        self._since_probe = 0
        self._probe: list[float] | None = None  # counted step times at the other count
        self._warm = False

    def start(self) -> None:
        self.set_threads(self.threads)
        self.on_change(self.threads, "start")

    @property
    def other(self) -> int:
        return 1 if self.threads != 1 else self.max_threads

    def observe(self, batch: int, seconds: float) -> None:
        """One decode step of `batch` sequences took `seconds` at the thread count set now."""
        if batch != self._batch:
            self._batch = batch
            self._recent.clear()
            if self._probe is not None:
                self._end_probe(None, "")
        if self._probe is not None:
            self._probe_step(seconds)
            return
        current = statistics.median(self._recent) if len(self._recent) >= 4 else None
        self._since_probe += 1
        if current is not None and seconds > self.collapse * current:
            # Kept out of the baseline until it persists (a GC pause is one slow step, contention is not);
            # then the slow steps are the baseline the probe must beat.
            self._slow.append(seconds)
            if len(self._slow) >= self.persist:
                self._recent.clear()
                self._recent.extend(self._slow)
                self._slow.clear()
                self._start_probe()
            return
        self._slow.clear()
        self._recent.append(seconds)
        if self._since_probe >= self.period and current is not None:
            self._start_probe()

    def _start_probe(self) -> None:
        self._probe = []
        self._warm = False
        self.set_threads(self.other)

    def _probe_step(self, seconds: float) -> None:
        assert self._probe is not None
        if not self._warm:  # the first step at a new count pays for waking its threads
            self._warm = True
            return
        self._probe.append(seconds)
        current = statistics.median(self._recent)  # never empty here: a probe starts from >= `persist` samples
        if len(self._probe) == 1 and seconds > 2 * current:
            self._end_probe(False, "")
            return
        if len(self._probe) >= self.probe_steps:
            probe = statistics.median(self._probe)
            faster = probe < (1 - self.margin) * current
            self._end_probe(faster, f"{1000 * probe:.1f} ms a step against {1000 * current:.1f} ms")

    def _end_probe(self, switch: bool | None, why: str) -> None:
        """Close the probe: switch to the probed count (True), keep the current one (False), or
        cancel it (None: no verdict, probe again after another period)."""
        probed = self.other
        self._probe = None
        self._since_probe = 0
        if switch:
            self.threads = probed
            self.switches += 1
            self.period = self.base_period
            self._recent.clear()
            log.info("intra-op threads -> %d (%s)", probed, why)
            self.on_change(probed, "probe")
            return
        self.set_threads(self.threads)
        if switch is False:
            self.period = min(self.max_period, self.period * 2)
