"""Short prompts beside a chunked prefill: the step's prefill budget shared within one priority.

    class TorchEngine(Beside, Admission, Stepper): ...   # data_plane/shard/engines/torch_engine.py
    batch = self._admit_beside(budget)                   # while a long prompt is chunk-prefilled
    self._prefill_with_chunk(batch, budget, decoding)    # one pass: decodes, batch, the chunk's share

Without it a long prompt's chunked prefill (``prefill_chunk`` tokens a step) holds back every
waiting prompt of its own priority until its last chunk: a 46-token enterprise question waited
0.3-0.4 s behind a 589-token enterprise conversation (one one-thread shard), which is what kept
enterprise TTFT p95 at 2x load above its bound (docs/RELIABILITY.md §8). vLLM's chunked prefill
shares a step's token budget instead (its v1 scheduler: running requests, the partial prefill
included, then waiting ones fill what is left; ``long_prefill_token_threshold`` caps one request's
share so short prompts are not blocked). Here, with the tier order kept strictly above it:

- while a prompt is chunk-prefilled, waiting prompts of the *same* priority at the head of the
  queue whose uncached tokens fit ``beside_prefill_share`` of the budget (together) are prefilled
  in the same forward pass as the chunk; the chunk shrinks to what is left, never below
  ``prefill_chunk * (1 - beside_prefill_share)`` tokens, so the long one still progresses every step;
- a strictly higher-priority waiter is never passed (it goes ahead or parks the chunk:
  torch_admission), and a lower-priority one never joins;
- the prompts taken ahead of a lower-priority chunk (torch_admission._admit_ahead) share that same
  single pass, and so do the running sequences' decode tokens (one pass a step, not a prefill pass and
  then a decode pass: vLLM's mixed batch). With speculative decoding on, such a step drafts nothing
  (the n-gram drafts resume at the next step without a chunk; its context catches up from the outputs).

Slots as in torch_admission: the prompts taken get the slots after the decoding ones and the
chunked (and parked) sequences move up. Counted in ``switchboard_shard_prefill_beside_chunk``
(StepListener.on_prefill_beside). Scheduler thread only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from data_plane.shard.engines.torch_config import EngineConfig, SeqState, StepListener

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Beside:
    # State owned by TorchEngine (set in its __init__); methods from Admission and Stepper.
    config: EngineConfig
    listener: StepListener
    _runner: Any
    _lock: threading.Lock
    _running: list[SeqState]
    _prefilling: SeqState | None
    _take_head: Callable[[Callable[[int], bool], int], tuple[list[SeqState], int]]
    _mark_admitted: Callable[[list[SeqState]], None]
    _resume_parked: Callable[[], None]
    _keep_prompt_blocks: Callable[[SeqState], None]
    _sample: Callable[[torch.Tensor, Sequence[SeqState]], list[int]]
    _emit: Callable[..., str]

    def _admit_beside(self, budget: int) -> list[SeqState]:
        """Waiting prompts of the chunked prefill's priority, from the head of the queue, whose
        uncached tokens fit the beside share of `budget` together and for which slots are free.
        They take the slots after the decoding ones; the chunked and parked sequences move up."""
        p = self._prefilling
        assert p is not None
        share = int(budget * self.config.beside_prefill_share)
        with self._lock:
            batch, used = self._take_head(lambda priority: priority == p.req.priority, share)
        if batch:
            self._mark_admitted(batch)
            self.listener.on_prefill_beside(len(batch))
            log.debug("%d prompt(s) of priority %d prefilled beside a chunked one (%d tokens; %d of its %d left)",
                      len(batch), p.req.priority, used, len(p.req.prompt_ids) - p.prefilled, len(p.req.prompt_ids))
        return batch

    def _prefill_with_chunk(self, batch: list[SeqState], budget: int, decoding: Sequence[SeqState] = ()) -> None:
        """One forward pass over the `decoding` sequences' next token, `batch` (whole prompts) and the chunked
        prefill's next chunk, which gets what `batch` leaves of `budget` (at least one token): vLLM's mixed
        step, one pass instead of a prefill pass and a decode pass. The prompts and, when this was its last
        chunk, the chunked one join the decode batch and get their first token; the decoding ones their next."""
        p = self._prefilling
        assert p is not None
        used = sum(len(s.req.prompt_ids) - s.prefilled for s in batch)
        chunk = p.req.prompt_ids[p.prefilled : p.prefilled + max(1, budget - used)]
        items = [(s.slot, [s.last_token], s.length) for s in decoding]
        items += [(s.slot, s.req.prompt_ids[s.prefilled :], s.prefilled) for s in batch]
        t0 = time.monotonic()
        logits = self._runner.prefill_batch(items + [(p.slot, chunk, p.prefilled)])
        now = time.monotonic()
        step_s = now - t0
        self.listener.on_step(len(items) + 1, step_s, "prefill")
        self.listener.on_iteration_tokens(len(decoding) + used + len(chunk))
        for seq in decoding:
            seq.length += 1
        p.prefilled += len(chunk)
        p.length = p.prefilled
        first = list(batch)
        last = p.prefilled >= len(p.req.prompt_ids)
        with self._lock:
            for seq in batch:
                seq.prefilled = seq.length = len(seq.req.prompt_ids)
                seq.prefill_done_at = now
                self._running.append(seq)
            if last:
                p.prefill_done_at = now
                self._running.append(p)  # its slot is the next one: the batch's slots came before it
                self._resume_parked()
                first.append(p)
        for seq in first:
            self._keep_prompt_blocks(seq)
        seqs = list(decoding) + first  # the chunk's row is the last one, used only when it was its last
        tokens = self._sample(logits[: len(seqs)], seqs)
        for seq in decoding:
            self.listener.on_token(step_s)
        for seq, token in zip(seqs, tokens):
            self._emit(seq, token)
