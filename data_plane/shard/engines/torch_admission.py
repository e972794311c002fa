"""The torch engine's admission: reaping aborted/expired requests and taking waiting ones into slots.

    class TorchEngine(Admission, Stepper): ...   # data_plane/shard/engines/torch_engine.py
    self._reap()                                 # each scheduler iteration, first
    batch = self._admit(budget)                  # or self._admit_ahead(budget) while a prompt is chunked

Waiting requests are a heap by (priority, arrival order). Prompts that fit the prefill budget
together are admitted as one batch; a longer one becomes the chunked `_prefilling` sequence.
While it is prefilled chunk by chunk, strictly higher-priority requests that fit may go ahead.
At admission the prefix cache's longest hit is copied into the slot. Scheduler thread only.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from data_plane.shard.engines.base import FINISH_ABORT
from data_plane.shard.engines.torch_config import EngineConfig, SeqState, StepListener

if TYPE_CHECKING:
    from data_plane.shard.engines.torch_prefix import SlotPrefix


class Admission:
    # State owned by TorchEngine (set in its __init__).
    config: EngineConfig
    listener: StepListener
    prefix: SlotPrefix | None
    _runner: Any
    _lock: threading.Lock
    _waiting: list[tuple[int, int, SeqState]]
    _running: list[SeqState]
    _prefilling: SeqState | None
    _aborts: set[str]
    _by_id: dict[str, SeqState]
    _finish: Callable[..., None]  # torch_step.Stepper._finish

    def _reap(self) -> None:
        now_wall = time.time()
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            expired = [s for _, _, s in self._waiting if s.req.deadline is not None and s.req.deadline < now_wall]
            aborts |= {
                s.req.request_id for s in self._running if s.req.deadline is not None and s.req.deadline < now_wall
            }
            if aborts or expired:
                gone = aborts | {s.req.request_id for s in expired}
                self._waiting = [e for e in self._waiting if e[2].req.request_id not in gone]
                heapq.heapify(self._waiting)
        for seq in expired:
            self._finish(seq, FINISH_ABORT)
        for rid in aborts:
            victim = self._by_id.get(rid)
            if victim is not None and not victim.finished:
                self._finish(victim, FINISH_ABORT)

    def _admit(self, budget: int) -> list[SeqState]:
        """Take waiting requests by priority while slots and the prefill budget allow.

        Prompts that fit the budget together are returned to be prefilled in one pass; a
        prompt longer than the budget (only as the first pick) becomes the chunked
        `_prefilling` sequence instead.
        """
        batch: list[SeqState] = []
        chunked: list[SeqState] = []
        used = 0
        with self._lock:
            while self._waiting and len(self._running) + len(batch) < self.config.max_num_seqs:
                seq = self._waiting[0][2]
                n = len(seq.req.prompt_ids) - self._cached_prefix(seq)
                if used + n > budget:
                    if not batch:
                        heapq.heappop(self._waiting)
                        seq.slot = len(self._running)
                        self._prefilling = seq
                        chunked.append(seq)
                    break
                heapq.heappop(self._waiting)
                seq.slot = len(self._running) + len(batch)
                batch.append(seq)
                used += n
        self._mark_admitted(chunked + batch)
        return batch

    def _admit_ahead(self, budget: int) -> list[SeqState]:
        """While a long prompt is prefilled chunk by chunk, let waiting requests of strictly higher
        priority whose prompts fit the budget go first: without it an enterprise request waits for
        the whole prefill of a free-tier prompt that was admitted before it (head-of-line blocking
        the admission queue cannot see). The chunked sequence moves one slot up per request taken,
        so slots stay compact (index == slot)."""
        p = self._prefilling
        assert p is not None
        batch: list[SeqState] = []
        used = 0
        with self._lock:
            while (self._waiting and self._waiting[0][2].req.priority < p.req.priority
                   and len(self._running) + len(batch) + 2 <= self.config.max_num_seqs):  # +1 taken, +1 chunked
                seq = self._waiting[0][2]
                n = len(seq.req.prompt_ids) - self._cached_prefix(seq)
                if used + n > budget:
                    break
                heapq.heappop(self._waiting)
                batch.append(seq)
                used += n
            if not batch:
                return batch
            base = len(self._running)
            target = base + len(batch)
            self._runner.move_slot(p.slot, target, p.length)
            p.slot = target
            for i, seq in enumerate(batch):
                seq.slot = base + i
        self._mark_admitted(batch)
        return batch

    def _cached_prefix(self, seq: SeqState) -> int:
        """Prompt tokens the prefix cache holds for `seq` (leaving at least one to compute)."""
        if self.prefix is None or not seq.block_hashes:
            return 0
        return self.prefix.cached_tokens(seq.block_hashes, len(seq.req.prompt_ids))

    def _mark_admitted(self, seqs: list[SeqState]) -> None:
        now = time.monotonic()
        for seq in seqs:
            seq.admitted_at = now
            self.listener.on_admit(now - seq.req.arrival)
            if self.prefix is not None:
                hit = self._cached_prefix(seq)
                seq.held = self.prefix.load(seq.block_hashes, hit, seq.slot)
                seq.cached = seq.prefilled = seq.length = hit
                self.listener.on_prefix_lookup(len(seq.req.prompt_ids), hit)
