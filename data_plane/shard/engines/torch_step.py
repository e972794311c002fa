"""The torch engine's compute steps: prefill (batched or chunked), decode, emit and finish.

    class TorchEngine(Admission, Stepper): ...   # data_plane/shard/engines/torch_engine.py
    self._prefill_batch(batch); self._decode_step()   # a chunk's pass: torch_beside._prefill_with_chunk
    self._emit(seq, token)                       # EOS, stop strings, max_tokens, context limit
    self._finish(seq, FINISH_STOP)               # slot freed (the last one moves in), final output

The forward passes are LlamaRunner's (data_plane/shard/engines/llama_runner.py); speculative decoding
(torch_spec.Speculator) takes the decode step over when a sequence drafted. Decoding slots are kept
compact (index in `_running` == slot). Prefix-cache blocks are kept once a prompt is prefilled and
when a sequence ends. Scheduler thread only.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from data_plane.shard.engines.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, GenerationOutput, RequestTimings
from data_plane.shard.engines.torch_config import SeqState, StepListener
from data_plane.shard.engines.torch_sampling import sample
from data_plane.shard.kv_transcript import GeneratedTokens

if TYPE_CHECKING:
    from data_plane.shard.engines.torch_prefix import SlotPrefix
    from data_plane.shard.engines.torch_spec import Speculator


class Stepper:
    # State owned by TorchEngine (set in its __init__ / _load).
    listener: StepListener
    prefix: SlotPrefix | None
    spec: Speculator | None
    transcripts: GeneratedTokens
    max_model_len: int
    _runner: Any
    _eos: set[int]
    _lock: threading.Lock
    _running: list[SeqState]
    _prefilling: SeqState | None
    _parked: list[SeqState]
    _by_id: dict[str, SeqState]
    _place_pending: Callable[[int], None]  # torch_admission.Admission
    _resume_parked: Callable[[], None]
    _decode_ids: Callable[[list[int]], str]

    def _prefill_batch(self, batch: list[SeqState]) -> None:
        t0 = time.monotonic()
        logits = self._runner.prefill_batch([(s.slot, s.req.prompt_ids[s.prefilled :], s.prefilled) for s in batch])
        now = time.monotonic()
        self.listener.on_step(len(batch), now - t0, "prefill")
        self.listener.on_iteration_tokens(sum(len(s.req.prompt_ids) - s.prefilled for s in batch))
        with self._lock:
            for seq in batch:
                seq.prefilled = seq.length = len(seq.req.prompt_ids)
                seq.prefill_done_at = now
                self._running.append(seq)
        for seq in batch:
            self._keep_prompt_blocks(seq)
        for seq, token in zip(batch, self._sample(logits, batch)):
            self._emit(seq, token)

    def _keep_prompt_blocks(self, seq: SeqState) -> None:
        if self.prefix is not None and seq.block_hashes:
            seq.held += self.prefix.keep(seq.block_hashes, seq.cached, seq.slot)

    def _keep_all_blocks(self, seq: SeqState) -> None:
        if self.prefix is not None:
            tokens = (seq.req.prompt_ids + seq.output_ids)[: seq.length]
            self.prefix.finish(tokens, seq.req.cache_salt, seq.req.public_prefix_tokens, seq.slot, seq.cached,
                               seq.held, seq.req)
            seq.held = []

    def _decode_step(self) -> bool:
        """One decode step of the running sequences; True when it was a speculative (verify) step."""
        batch = self._running
        if self.spec is not None and self.spec.step(self, batch):  # type: ignore[arg-type]  # a TorchEngine
            return True
        t0 = time.monotonic()
        logits = self._runner.decode([s.last_token for s in batch], [s.length for s in batch])
        for s in batch:
            s.length += 1
        tokens = self._sample(logits, batch)
        step_s = time.monotonic() - t0
        if self.spec is not None:
            self.spec.observe_plain(len(batch), step_s)
        self.listener.on_step(len(batch), step_s, "decode")
        self.listener.on_iteration_tokens(len(batch))
        for seq, token in zip(list(batch), tokens):
            self.listener.on_token(step_s)
            self._emit(seq, token)
        return False

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: Sequence[SeqState]) -> list[int]:
        return sample(logits, [s.req.params for s in seqs], [s.generator for s in seqs],
                      [s.req.processor for s in seqs])

    def _emit(self, seq: SeqState, token: int, held: str = "", send: bool = True) -> str:
        """Take one sampled token; with `send` False its text is returned (prefixed by `held`)
        instead of streamed, so a speculative step's tokens leave as one output."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.listener.on_first_token(now - seq.req.arrival)
        seq.last_token = token
        if token in self._eos:
            self._finish(seq, FINISH_STOP, held)
            return ""
        seq.output_ids.append(token)
        delta = held + seq.stream.push(token)
        if seq.stream.stopped:
            self._finish(seq, FINISH_STOP, delta)
            return ""
        if len(seq.output_ids) >= seq.max_tokens or seq.length + 1 >= self.max_model_len:
            self._finish(seq, FINISH_LENGTH, delta)
            return ""
        if not send:
            return delta
        if delta:
            seq.sink(GenerationOutput(delta, None, len(seq.req.prompt_ids), len(seq.output_ids),
                                      cached_tokens=seq.cached))
        return ""

    def _finish(self, seq: SeqState, reason: str, delta: str = "") -> None:
        seq.finished = True
        if reason != FINISH_ABORT:
            delta += seq.stream.flush()
            # With prefix caching on or off alike, so that reuse never changes what the model is shown.
            if self._decode_ids(seq.output_ids) == seq.stream.text:
                self.transcripts.remember(seq.req.cache_salt, seq.stream.text, seq.output_ids)
        now = time.monotonic()
        self._keep_all_blocks(seq)  # before its slot is reused or overwritten by a move
        with self._lock:
            self._by_id.pop(seq.req.request_id, None)
            if seq in self._running:
                idx = self._running.index(seq)
                last = self._running[-1]
                if last is not seq:
                    # Keep decoding slots compact: the last sequence moves into the hole.
                    self._runner.move_slot(last.slot, seq.slot, last.length)
                    last.slot = seq.slot
                    self._running[idx] = last
                self._running.pop()
                self._place_pending(len(self._running))
            elif self._prefilling is seq:
                self._resume_parked()
            elif seq in self._parked:
                self._parked.remove(seq)
                self._place_pending(len(self._running))
        admitted = seq.admitted_at or now
        timings = RequestTimings(
            queued_s=admitted - seq.req.arrival,
            prefill_s=(seq.prefill_done_at - admitted) if seq.prefill_done_at else 0.0,
            decode_s=(now - seq.prefill_done_at) if seq.prefill_done_at else 0.0,
            first_token_at=seq.first_token_at,
        )
        sp = seq.spec
        seq.sink(GenerationOutput(delta, reason, len(seq.req.prompt_ids), len(seq.output_ids), timings,
                                  cached_tokens=seq.cached, spec_drafts=sp.drafts if sp else 0,
                                  spec_draft_tokens=sp.draft_tokens if sp else 0,
                                  spec_accepted_tokens=sp.accepted_tokens if sp else 0))
