"""The torch engine's update step: a step's tokens into the sequences, their streams and the metrics.

    out = OutputProcessor(scheduler, lock, by_id, listener, transcripts, decode_ids, eos, max_model_len, prefix)
    out.admit(plan)                      # before the pass: admission times, cached prefix, metrics
    out.update(plan, result)             # after it: computed counts, first/next tokens, finishes
    out.finish(seq, FINISH_ABORT)        # final output, prefix blocks kept, slot freed (scheduler.finish)

Called by the engine loop (torch_engine.py: schedule -> execute -> update) on the scheduler thread.
Each sampled token goes through `emit` one by one (EOS, stop strings, max_tokens, the context
limit), so a verify step's accepted drafts cut exactly where plain decoding would; their text
leaves as one stream output. A sequence's `num_computed_tokens` moves past its prompt rows at once
and past a decode/verify row token by token (the last emitted token is never in the KV yet).
Prefix-cache blocks are kept once a prompt is in and when a sequence ends, before any later plan
can move another sequence's KV into its slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from data_plane.shard.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RequestTimings,
    StageSpan,
)
from data_plane.shard.engines.scheduler import RowKind, Scheduler, SchedulerOutput
from data_plane.shard.engines.sequence import STATUS_OF_REASON, SeqState

if TYPE_CHECKING:
    from data_plane.shard.engines.torch_config import StepListener
    from data_plane.shard.engines.torch_executor import StepResult
    from data_plane.shard.engines.torch_prefix import SlotPrefix
    from data_plane.shard.kv_transcript import GeneratedTokens


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, lock: threading.Lock, by_id: dict[str, SeqState],
                 listener: StepListener, transcripts: GeneratedTokens, decode_ids: Callable[[list[int]], str],
                 eos: set[int], max_model_len: int, prefix: SlotPrefix | None) -> None:
        self.scheduler = scheduler
        self.lock = lock
        self.by_id = by_id
        self.listener = listener
        self.transcripts = transcripts
        self.decode_ids = decode_ids
        self.eos = eos
        self.max_model_len = max_model_len
        self.prefix = prefix
        self.stage_spans: Callable[[int], tuple[StageSpan, ...]] = lambda slot: ()  # a pipeline's Hops.take

    def admit(self, plan: SchedulerOutput) -> None:
        now = time.monotonic()
        for seq in plan.admitted:
            seq.admitted_at = now
            self.listener.on_admit(now - seq.req.arrival)
            if self.prefix is not None:
                seq.cached = seq.num_computed_tokens  # the scheduler counted the prefix cache's hit as computed
                self.listener.on_prefix_lookup(seq.num_prompt_tokens, seq.cached)
        if plan.parked is not None:
            self.listener.on_preempt("prefill")
        if plan.decode_yield:
            self.listener.on_preempt("decode")
        if plan.beside:
            self.listener.on_prefill_beside(plan.beside)

    def update(self, plan: SchedulerOutput, result: StepResult) -> None:
        now = time.monotonic()
        step_s = result.seconds
        for row in plan.rows:
            seq = row.seq
            if row.kind is RowKind.PREFILL:
                seq.num_computed_tokens = row.start + len(row.tokens)
                if not seq.prefilling:
                    seq.prefill_done_at = now
                    self._keep_prompt_blocks(seq)
        self.listener.on_step(len(plan.rows), step_s, "decode" if plan.is_decode else "prefill")
        self.listener.on_iteration_tokens(plan.num_tokens)
        for row, tokens in zip(plan.rows, result.tokens):
            seq = row.seq
            failure = seq.req.processor.failure() if seq.req.processor is not None else None
            if failure is not None:  # its grammar stopped short of a whole output: this step's tokens go too
                self.fail(seq, failure)
                continue
            if row.draft and seq.spec is not None:
                seq.spec.record(len(row.draft), len(tokens) - 1, row.match_n)
                self.listener.on_spec_draft(len(row.draft), len(tokens) - 1)
            held = ""
            for i, token in enumerate(tokens):
                if row.kind is not RowKind.PREFILL:
                    seq.num_computed_tokens = row.start + 1 + i
                    self.listener.on_token(step_s / len(tokens))
                held = self.emit(seq, token, held, send=i == len(tokens) - 1)
                if seq.finished:
                    break

    def emit(self, seq: SeqState, token: int, held: str = "", send: bool = True) -> str:
        """Take one sampled token; with `send` False its text is returned (prefixed by `held`)
        instead of streamed, so a verify step's tokens leave as one output."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            # the prompt's prefill time too: observed with TTFT, not at the end (shard/metrics.py on_first_token)
            self.listener.on_first_token(now - seq.req.arrival, (seq.prefill_done_at - (seq.admitted_at or now))
                                         if seq.prefill_done_at else None)
        seq.last_token = token
        if token in self.eos:
            self.finish(seq, FINISH_STOP, held)
            return ""
        seq.output_ids.append(token)
        delta = held + seq.stream.push(token)
        if seq.stream.stopped:
            self._drop_stopped_logprobs(seq, delta)
            self.finish(seq, FINISH_STOP, delta)
            return ""
        if len(seq.output_ids) >= seq.max_tokens or seq.num_computed_tokens + 1 >= self.max_model_len:
            self.finish(seq, FINISH_LENGTH, delta)
            return ""
        if not send:
            return delta
        if delta:
            seq.sink(GenerationOutput(delta, None, seq.num_prompt_tokens, len(seq.output_ids),
                                      cached_tokens=seq.cached))
        return ""

    def _drop_stopped_logprobs(self, seq: SeqState, kept: str) -> None:
        """A stop string is cut from the text, so its tokens' logprobs go too: `logprobs.content` spells
        the content, as OpenAI's does (they were sent after it). The logprobs not yet sent are those of
        the last tokens, whose text not yet sent is `kept` (the text before the stop string): a token
        that starts before the cut keeps its entry, the ones after it are dropped."""
        proc = seq.req.processor
        pending = getattr(proc, "logprobs", None)
        if not pending:
            return
        ids = seq.output_ids[-len(pending):]
        keep = 0
        while keep < len(ids) and len(self.decode_ids(ids[:keep])) < len(kept):
            keep += 1
        del pending[keep:]

    def fail(self, seq: SeqState, error: Exception) -> None:
        """End `seq` with `error` (its stream raises it: a 4xx before the first byte, an error event after),
        freed as an abort is."""
        seq.sink(error)
        self.finish(seq, FINISH_ABORT)

    def finish(self, seq: SeqState, reason: str, delta: str = "") -> None:
        if reason != FINISH_ABORT:
            delta += seq.stream.flush()
            # With prefix caching on or off alike, so that reuse never changes what the model is shown.
            if self.decode_ids(seq.output_ids) == seq.stream.text:
                self.transcripts.remember(seq.req.cache_salt, seq.stream.text, seq.output_ids)
        now = time.monotonic()
        stages = self.stage_spans(seq.slot) if seq.slot >= 0 else ()
        self._keep_all_blocks(seq)  # before a later plan moves another sequence into its slot
        with self.lock:
            self.by_id.pop(seq.request_id, None)
            self.scheduler.finish(seq, STATUS_OF_REASON[reason])
        admitted = seq.admitted_at or now
        timings = RequestTimings(
            queued_s=admitted - seq.req.arrival,
            prefill_s=(seq.prefill_done_at - admitted) if seq.prefill_done_at else 0.0,
            decode_s=(now - seq.prefill_done_at) if seq.prefill_done_at else 0.0,
            first_token_at=seq.first_token_at,
        )
        sp = seq.spec
        seq.sink(GenerationOutput(delta, reason, seq.num_prompt_tokens, len(seq.output_ids), timings,
                                  cached_tokens=seq.cached, spec_drafts=sp.drafts if sp else 0,
                                  spec_draft_tokens=sp.draft_tokens if sp else 0,
                                  spec_accepted_tokens=sp.accepted_tokens if sp else 0, stages=stages))

    def _keep_prompt_blocks(self, seq: SeqState) -> None:
        if self.prefix is not None and seq.block_hashes:
            seq.held += self.prefix.keep(seq.block_hashes, seq.cached, seq.slot, seq.req.trace)

    def _keep_all_blocks(self, seq: SeqState) -> None:
        if self.prefix is not None:
            tokens = (seq.req.prompt_ids + seq.output_ids)[: seq.num_computed_tokens]
            self.prefix.finish(tokens, seq.req.cache_salt, seq.req.public_prefix_tokens, seq.slot, seq.cached,
                               seq.held, seq.req)
            seq.held = []
