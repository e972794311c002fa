"""A pipeline's batch queue: up to B scheduler plans in flight through the stages at once.

    queue = BatchQueue(plan, scheduler, executor, output, lock, observe)   # scheduler.config.batch_queue = B
    while running:
        if not queue.step():          # one iteration; False: nothing to do
            wait_for_work()

vLLM v1's `EngineCore.step_with_batch_queue` is the model (its batch queue holds as many batches
as pipeline stages, so every stage stays busy). Each iteration, while fewer than B plans are in
flight, the engine plans one (its `_plan`: schedule() and what surrounds it) and the executor sends it (the slot moves, prefix loads and stage
0's layers run now; `Executor.submit`): filling the queue comes first, so stage 0 runs its layers
for *other* sequences while earlier plans are still in the later stages. When the queue is full,
or the scheduler has nothing to add beside the plans in flight (a sequence in flight is in no
other plan; a layout change waits for the pipeline to drain: scheduler.py), the oldest plan's
rows are collected (`Executor.complete`: in the order sent), the scheduler is told it `returned`
and the output processor updates its sequences (computed counts, tokens, finishes, prefix blocks).

A decode plan goes as one micro-batch (the queue overlaps it with the other groups; splitting it
again would only read the weights more often); a plan with prompt rows goes alone (nothing is
planned beside it), so it is split into the pipeline's `--pipeline-microbatches` in-step. Called
on the engine's scheduler thread only (torch_engine.TorchEngine._step).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from data_plane.shard.engines.scheduler import Scheduler, SchedulerOutput
    from data_plane.shard.engines.torch_config import StepListener
    from data_plane.shard.engines.torch_executor import Executor, Pending
    from data_plane.shard.engines.torch_output import OutputProcessor

log = logging.getLogger(__name__)


class BatchQueue:
    def __init__(self, plan: Callable[[], SchedulerOutput], scheduler: Scheduler, executor: Executor,
                 output: OutputProcessor, lock: threading.Lock, observe: Callable[[SchedulerOutput, float], None],
                 listener: StepListener | None = None) -> None:
        self.plan = plan  # the engine's _plan: schedule(), prefix hits reserved, reaped finished, admissions
        self.scheduler, self.executor, self.output, self.lock = scheduler, executor, output, lock
        self.listener = listener  # on_batch_sent: switchboard_shard_pipeline_steps_in_flight
        self.observe = observe  # a pass's cost, for the speculator and the thread tuner (only passes alone)
        self.depth = scheduler.config.batch_queue
        self._queue: deque[tuple[Pending, bool]] = deque()  # in flight, oldest first; (plan, sent alone)
        self.sent = self.sent_beside = 0
        """Plans sent; of them, sent while others were in flight (the overlap across steps)."""

    def __len__(self) -> int:
        return len(self._queue)

    def step(self) -> bool:
        """Send one plan, or collect and update from the oldest; False when there was nothing to do."""
        queue = self._queue
        if len(queue) < self.depth:
            plan = self.plan()
            if plan.rows:
                queue.append((self.executor.submit(plan, microbatches=1 if plan.is_decode else None), not queue))
                self.sent += 1
                if len(queue) > 1:
                    self.sent_beside += 1
                    if self.sent_beside == 1:
                        log.info("pipeline batch queue: a plan sent beside %d in flight (up to %d)",
                                 len(queue) - 1, self.depth)
                if self.listener is not None:
                    self.listener.on_batch_sent(len(queue), plan.is_decode)
                return True
            if not queue:
                return bool(plan.finished)
        self._complete()
        return True

    def drain(self) -> None:
        """Collect every plan in flight (the engine stopping: no stage is left sending rows back)."""
        while self._queue:
            self._complete()

    def _complete(self) -> None:
        queue = self._queue
        pending, alone = queue.popleft()
        result = self.executor.complete(pending)
        with self.lock:
            self.scheduler.returned(pending.plan)
        self.output.update(pending.plan, result)
        if alone and not queue:  # nothing overlapped its pass: its time is its cost
            self.observe(pending.plan, result.seconds)
