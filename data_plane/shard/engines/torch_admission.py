"""The torch engine's admission: reaping aborted/expired requests and taking waiting ones into slots.

    class TorchEngine(Admission, Stepper): ...   # data_plane/shard/engines/torch_engine.py
    self._reap()                                 # each scheduler iteration, first
    batch = self._admit(budget)                  # or self._admit_ahead(budget) while a prompt is chunked

Waiting requests are a heap by (priority, arrival order). Prompts that fit the prefill budget
together are admitted as one batch; a longer one becomes the chunked `_prefilling` sequence.
While it is prefilled chunk by chunk, strictly higher-priority requests go first: those that fit
the budget are prefilled ahead of it, and a longer one *preempts* it: the chunked sequence is
parked with its KV in its slot (`_parked`, resumed where it stopped once the higher one is done,
nothing recomputed). So a long enterprise prompt never waits for a free prompt's whole prefill.
Short prompts of the chunked one's *own* priority are prefilled beside it (torch_beside), so within a
tier only a long prompt waits for another long one.
At admission the prefix cache's longest hit is copied into the slot. Scheduler thread only.

Slots: decoding sequences hold slots 0..len(_running)-1 (index == slot); the chunked prefill the
next one, the parked ones those after it, in order (`_place_pending` keeps it so).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from data_plane.shard.engines.base import FINISH_ABORT
from data_plane.shard.engines.torch_config import EngineConfig, SeqState, StepListener

if TYPE_CHECKING:
    from data_plane.shard.engines.torch_prefix import SlotPrefix

log = logging.getLogger(__name__)


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
    _parked: list[SeqState]  # chunked prefills preempted by a higher-priority one (slot order)
    _aborts: set[str]
    _by_id: dict[str, SeqState]
    _finish: Callable[..., None]  # torch_step.Stepper._finish

    def _reap(self) -> None:
        now_wall = time.time()
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            expired = [s for _, _, s in self._waiting if s.req.deadline is not None and s.req.deadline < now_wall]
            aborts |= {
                s.req.request_id for s in self._running + self._pending()
                if s.req.deadline is not None and s.req.deadline < now_wall
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
        """While a long prompt is prefilled chunk by chunk, waiting requests of strictly higher
        priority go first: without it an enterprise request waits for the whole prefill of a
        free-tier prompt that was admitted before it (head-of-line blocking the admission queue
        cannot see). Those whose prompts fit the budget are returned, to be prefilled in this step;
        the chunked sequence (and any parked one) moves one slot up per request taken, so slots stay
        compact. A longer one preempts the chunked sequence instead (`_preempt_prefill`)."""
        p = self._prefilling
        assert p is not None
        with self._lock:
            batch, _ = self._take_head(lambda priority: priority < p.req.priority, budget)
            preempted = None if batch else self._preempt_prefill(p)
        if preempted is not None:
            self._mark_admitted([preempted])
            self.listener.on_preempt("prefill")
            log.info("chunked prefill of priority %d parked for one of priority %d (%d prompt tokens)",
                     p.req.priority, preempted.req.priority, len(preempted.req.prompt_ids))
        self._mark_admitted(batch)
        return batch

    def _take_head(self, accept: Callable[[int], bool], budget: int) -> tuple[list[SeqState], int]:
        """Pop waiting requests from the head while `accept(priority)`, a slot beside the pending ones and
        `budget` (their uncached prompt tokens together) allow; give them the slots after the decoding
        ones (the pending sequences move up). Returns them and their tokens. Under the lock."""
        batch: list[SeqState] = []
        used = 0
        pending = len(self._pending())
        while (self._waiting and accept(self._waiting[0][2].req.priority)
               and len(self._running) + len(batch) + 1 + pending <= self.config.max_num_seqs):
            seq = self._waiting[0][2]
            n = len(seq.req.prompt_ids) - self._cached_prefix(seq)
            if used + n > budget:
                break
            heapq.heappop(self._waiting)
            batch.append(seq)
            used += n
        if batch:
            base = len(self._running)
            self._place_pending(base + len(batch))
            for i, seq in enumerate(batch):
                seq.slot = base + i
        return batch, used

    def _preempt_prefill(self, p: SeqState) -> SeqState | None:
        """Park the chunked prefill `p` for a waiting request of strictly higher priority whose prompt
        is too long for this step's budget, if a slot is free; return the request taken (now the
        chunked one). `p` keeps its KV and its progress, one slot up. Under the lock."""
        if not self._waiting or len(self._running) + 2 + len(self._parked) > self.config.max_num_seqs:
            return None
        head = self._waiting[0][2]
        if head.req.priority >= p.req.priority:
            return None
        heapq.heappop(self._waiting)
        self._prefilling = None
        self._parked.insert(0, p)
        self._place_pending(len(self._running) + 1)
        head.slot = len(self._running)
        self._prefilling = head
        return head

    def _pending(self) -> list[SeqState]:
        """Sequences holding a slot that do not decode yet: the chunked prefill, then the parked ones."""
        return ([self._prefilling] if self._prefilling is not None else []) + self._parked

    def _place_pending(self, base: int) -> None:
        """Move the pending sequences to slots base, base+1, ...: downward moves lowest first and upward
        ones highest first, so no move overwrites a slot still to be moved."""
        moves = [(s, base + i) for i, s in enumerate(self._pending()) if s.slot != base + i]
        down = [m for m in moves if m[1] < m[0].slot]
        up = [m for m in moves if m[1] > m[0].slot]
        for seq, dst in down + up[::-1]:
            self._runner.move_slot(seq.slot, dst, seq.length)
            seq.slot = dst

    def _resume_parked(self) -> None:
        """The chunked prefill is done or gone: the most recently parked one (if any) carries on."""
        self._prefilling = self._parked.pop(0) if self._parked else None
        self._place_pending(len(self._running))

    def _decode_yields(self) -> bool:
        """Skip this step's decode: a chunked prefill of strictly higher priority than every decoding
        sequence is under way, so it gets the step to itself (its time to first token is not paid
        in the lower tiers' decode passes); they go on once it is prefilled."""
        p = self._prefilling
        return p is not None and all(s.req.priority > p.req.priority for s in self._running)

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
