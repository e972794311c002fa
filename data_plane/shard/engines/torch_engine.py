"""The torch engine: continuous batching over a slot KV cache, on CPU.

    engine = TorchEngine(EngineConfig(model=None, dtype="bfloat16"))
    await engine.start()                     # loads the model (progress on stdout)
    async for out in engine.generate(req):   # see data_plane.shard.engines.base
        ...
    await engine.aclose()

One scheduler thread owns the model. Each iteration it (1) drops aborted and expired
requests, (2) admits waiting requests by priority into free slots while the KV budget
allows, (3) runs one prefill chunk for the sequence being prefilled, (4) runs one decode
step over every running sequence together, and (5) fans outputs out to per-request
asyncio queues on the event loop. Finished and aborted sequences leave the batch at once
and their slot is reused by the next admission; requests join between steps.

Prefix caching (on by default, data_plane/shard/engines/kv_cache.py): at admission a request's longest cached
prefix (full 16-token blocks, chained digests salted with its `cache_salt`) is copied into its
slot and only the rest is prefilled; its prompt blocks are kept once prefilled and its output
blocks when it ends, so the next turn of a conversation computes only its new tokens. The
blocks a running sequence uses are referenced and never evicted.

Compute runs in that thread (torch releases the GIL inside ops) so the event loop stays
free to stream tokens and accept requests.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import torch

from data_plane.shard.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    RequestTimings,
    SamplingParams,
    TextStream,
    check_lengths,
)
from data_plane.common.errors import Overloaded
from data_plane.shard.engines.torch_prefix import SlotPrefix
from data_plane.shard.engines.torch_spec import Speculator
from data_plane.shard.engines.kv_cache import DEFAULT_BLOCK_SIZE
from data_plane.shard.kv_transcript import GeneratedTokens
from data_plane.shard.engines.speculation import SeqSpec

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Local HF folder or GGUF file; None = the default SmolLM2-135M-Instruct."""
    dtype: str = "bfloat16"
    """bfloat16 (fast) or float32 (batch-invariant greedy output)."""
    max_num_seqs: int = 16
    """Sequences decoded together (KV slots), 1..256."""
    max_model_len: int = 2048
    """Context window served (prompt + output), capped by the model's own."""
    prefill_chunk: int = 256
    """Prompt tokens processed per scheduler iteration, so long prompts don't stall decoding."""
    max_waiting: int = 256
    """Queue bound; beyond it new requests get 503 with Retry-After."""
    threads: int = 0
    """torch intra-op threads; 0 = all cores."""
    prefix_caching: bool = True
    """Keep KV after requests end and reuse the longest cached prompt prefix."""
    prefix_cache_bytes: int = 0
    """Byte budget of the prefix cache; 0 = auto (1/16 of RAM, at most 1 GiB)."""
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per prefix-cache block, 1..1024 (the reuse granularity)."""
    speculation: str = "off"
    """ngram (prompt-lookup drafts verified in the decode pass, data_plane/shard/engines/torch_spec.py) or off."""
    num_speculative_tokens: int = 4
    """Most draft tokens per sequence and step, 1..16."""
    spec_max_batch: int = 4
    """No drafting while more sequences than this run, 1..256 (measured: docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        if not 1 <= self.max_num_seqs <= 256:
            raise ValueError("max_num_seqs must be in 1..256")
        if not 16 <= self.max_model_len <= 131072:
            raise ValueError("max_model_len must be in 16..131072")
        if not 1 <= self.prefill_chunk <= 8192:
            raise ValueError("prefill_chunk must be in 1..8192")
        if not 1 <= self.kv_block_size <= 1024:
            raise ValueError("kv_block_size must be in 1..1024")
        if self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0 (0 = auto)")
        if self.speculation not in ("ngram", "off"):
            raise ValueError("speculation must be ngram or off")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16")
        if not 1 <= self.spec_max_batch <= 256:
            raise ValueError("spec_max_batch must be in 1..256")


@dataclass
class _Sequence:
    req: GenerationRequest
    max_tokens: int
    sink: Callable[[GenerationOutput], None]
    stream: TextStream
    generator: torch.Generator | None
    slot: int = -1
    prefilled: int = 0
    length: int = 0  # tokens in the KV cache
    last_token: int = -1
    output_ids: list[int] = field(default_factory=list)
    admitted_at: float = 0.0
    prefill_done_at: float = 0.0
    first_token_at: float | None = None
    finished: bool = False
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    held: list[int] = field(default_factory=list)  # prefix-cache blocks referenced by this sequence
    spec: SeqSpec | None = None  # speculation state (data_plane/shard/engines/torch_spec.py), when drafting is on
    spec_ctx: list[int] = field(default_factory=list)  # prompt + output, append-only, for the n-gram index


class StepListener:
    """Hooks the shard's metrics into the scheduler (called from the engine thread)."""

    def on_step(self, batch_size: int, step_s: float, kind: str) -> None: ...

    def on_first_token(self, seq_ttft_s: float) -> None: ...

    def on_token(self, itl_s: float) -> None: ...

    def on_admit(self, queue_s: float) -> None: ...

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None: ...

    def on_kv_evict(self, reason: str, blocks: int) -> None: ...

    def on_tokens_restored(self, replies: int) -> None: ...

    def on_iteration_tokens(self, tokens: int) -> None: ...

    def on_spec_draft(self, drafted: int, accepted: int) -> None: ...


class TorchEngine:
    def __init__(self, config: EngineConfig, listener: StepListener | None = None) -> None:
        self.config = config
        self.listener = listener or StepListener()
        self.model_name = "unloaded"
        self.max_model_len = config.max_model_len
        self._runner = None
        self._tokenizer = None
        self._eos: set[int] = set()
        self._waiting: list[tuple[int, int, _Sequence]] = []
        self._counter = itertools.count()
        self._running: list[_Sequence] = []  # decode batch, index == slot
        self._prefilling: _Sequence | None = None
        self._aborts: set[str] = set()
        self._by_id: dict[str, _Sequence] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None
        self.prefix: SlotPrefix | None = None
        self.transcripts = GeneratedTokens()
        self.spec = (Speculator(config.num_speculative_tokens, config.spec_max_batch)
                     if config.speculation == "ngram" else None)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from data_plane.shard.engines.llama_runner import LlamaRunner
        from data_plane.model_store import resolve_model, served_name

        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        t0 = time.monotonic()
        path = resolve_model(self.config.model)
        print(f"[switchboard] loading model from {path} ({self.config.dtype})...", flush=True)
        hf_config = AutoConfig.from_pretrained(str(path))
        self.max_model_len = min(self.config.max_model_len, hf_config.max_position_embeddings)
        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._runner = LlamaRunner.from_pretrained(
            path, dtype=DTYPES[self.config.dtype], max_num_seqs=self.config.max_num_seqs, max_len=self.max_model_len
        )
        eos = hf_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        if self._tokenizer.eos_token_id is not None:
            self._eos.add(self._tokenizer.eos_token_id)
        self.model_name = served_name(self.config.model)
        if self.config.prefix_caching:
            self.prefix = SlotPrefix.build(self._runner, model_id=str(path), dtype=self.config.dtype,
                                           block_size=self.config.kv_block_size,
                                           budget_bytes=self.config.prefix_cache_bytes,
                                           on_evict=self.listener.on_kv_evict)
        # One tiny warm-up pass so the first request doesn't pay for lazy kernel setup.
        self._runner.prefill(0, [self._tokenizer.bos_token_id or 1], 0)
        self._runner.decode([1], [1])
        print(
            f"[switchboard] model {self.model_name} ready in {time.monotonic() - t0:.1f} s "
            f"(KV cache {self._runner.kv_cache_bytes / 2**20:.0f} MiB for "
            f"{self.config.max_num_seqs} x {self.max_model_len} tokens; prefix cache "
            f"{self.prefix.cache.capacity_bytes / 2**20 if self.prefix else 0:.0f} MiB)",
            flush=True,
        )

    async def aclose(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # -- API ---------------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]], continue_final: bool = False) -> list[int]:
        ids = self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=not continue_final, continue_final_message=continue_final,
            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def restore_generated(self, messages: Sequence[dict[str, str]], ids: list[int], salt: str | None) -> list[int]:
        """`ids` with earlier replies this shard generated put back as the tokens it generated
        (their re-tokenization may differ, which would end a prefix-cache hit there)."""
        out, restored = self.transcripts.splice(messages, ids, salt, self.encode_chat)
        if restored:
            self.listener.on_tokens_restored(restored)
        return out

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def stats(self) -> EngineStats:
        with self._lock:
            running = len(self._running) + (1 if self._prefilling else 0)
            waiting = len(self._waiting)
            used = sum(s.length for s in self._running) + (self._prefilling.length if self._prefilling else 0)
        cap = self.config.max_num_seqs * self.max_model_len
        pc = self.prefix.cache if self.prefix else None
        return EngineStats(running=running, waiting=waiting, kv_usage=used / cap, max_num_seqs=self.config.max_num_seqs,
                           prefix_cache_blocks=pc.used_blocks if pc else 0,
                           prefix_cache_block_bytes=pc.block_bytes if pc else 0,
                           prefix_cache_capacity_bytes=pc.capacity_bytes if pc else 0)

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Validate and enqueue `req` now (raising 4xx/503 errors before any compute);
        return the iterator of its outputs. Closing the iterator early aborts the request."""
        if self.dead is not None:
            raise Overloaded("the engine has failed; this shard is restarting", retry_after=5)
        max_tokens = check_lengths(len(req.prompt_ids), req.params.max_tokens, self.max_model_len)
        queue: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        loop = self._loop or asyncio.get_running_loop()

        def sink(out: GenerationOutput | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        gen = None
        if not req.params.greedy:
            gen = torch.Generator()
            gen.manual_seed(req.params.seed if req.params.seed is not None else torch.seed())
        seq = _Sequence(
            req=req,
            max_tokens=max_tokens,
            sink=sink,
            stream=TextStream(self._decode_ids, req.params.stop),
            generator=gen,
        )
        if self.prefix is not None:
            seq.block_hashes = self.prefix.hashes(req.prompt_ids, req.cache_salt, req.public_prefix_tokens)
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise Overloaded("the shard's queue is full; retry shortly", retry_after=1)
            if req.request_id in self._by_id:
                raise Overloaded("a request with this id is already running", code="duplicate_request_id")
            self._by_id[req.request_id] = seq
            heapq.heappush(self._waiting, (req.priority, next(self._counter), seq))
        self._wake.set()
        return self._outputs(seq, queue)

    async def _outputs(
        self, seq: _Sequence, queue: asyncio.Queue[GenerationOutput | BaseException]
    ) -> AsyncIterator[GenerationOutput]:
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                await self.abort(seq.req.request_id)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._by_id:
                self._aborts.add(request_id)
        self._wake.set()

    # -- scheduler thread -------------------------------------------------------------------

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _run(self) -> None:
        try:
            while not self._stop:
                if not self._step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # a dead engine fails every request, loudly
            log.exception("engine scheduler died")
            self.dead = exc
            with self._lock:
                seqs = list(self._by_id.values())
            for seq in seqs:
                seq.sink(Overloaded("the engine failed; retry on another shard", retry_after=1))

    def _step(self) -> bool:
        """One scheduler iteration; returns False when there was nothing to do."""
        self._reap()
        did = False
        budget = self.config.prefill_chunk
        if self._prefilling is None:
            batch = self._admit(budget)
            if batch:
                self._prefill_batch(batch)
                did = True
        else:
            batch = self._admit_ahead(budget)
            if batch:
                self._prefill_batch(batch)
                budget = max(1, budget - sum(len(s.req.prompt_ids) - s.cached for s in batch))
                did = True
        if self._prefilling is not None:
            self._prefill_chunk(budget)
            did = True
        if self._running:
            self._decode_step()
            did = True
        return did

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
            seq = self._by_id.get(rid)
            if seq is not None and not seq.finished:
                self._finish(seq, FINISH_ABORT)

    def _admit(self, budget: int) -> list[_Sequence]:
        """Take waiting requests by priority while slots and the prefill budget allow.

        Prompts that fit the budget together are returned to be prefilled in one pass; a
        prompt longer than the budget (only as the first pick) becomes the chunked
        `_prefilling` sequence instead.
        """
        batch: list[_Sequence] = []
        chunked: list[_Sequence] = []
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

    def _admit_ahead(self, budget: int) -> list[_Sequence]:
        """While a long prompt is prefilled chunk by chunk, let waiting requests of strictly higher
        priority whose prompts fit the budget go first: without it an enterprise request waits for
        the whole prefill of a free-tier prompt that was admitted before it (head-of-line blocking
        the admission queue cannot see). The chunked sequence moves one slot up per request taken,
        so slots stay compact (index == slot)."""
        p = self._prefilling
        assert p is not None
        batch: list[_Sequence] = []
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

    def _cached_prefix(self, seq: _Sequence) -> int:
        """Prompt tokens the prefix cache holds for `seq` (leaving at least one to compute)."""
        if self.prefix is None or not seq.block_hashes:
            return 0
        return self.prefix.cached_tokens(seq.block_hashes, len(seq.req.prompt_ids))

    def _mark_admitted(self, seqs: list[_Sequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            seq.admitted_at = now
            self.listener.on_admit(now - seq.req.arrival)
            if self.prefix is not None:
                hit = self._cached_prefix(seq)
                seq.held = self.prefix.load(seq.block_hashes, hit, seq.slot)
                seq.cached = seq.prefilled = seq.length = hit
                self.listener.on_prefix_lookup(len(seq.req.prompt_ids), hit)

    def _prefill_batch(self, batch: list[_Sequence]) -> None:
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

    def _prefill_chunk(self, budget: int) -> int:
        """Prefill up to `budget` prompt tokens of the sequence being prefilled; return how many."""
        seq = self._prefilling
        assert seq is not None
        ids = seq.req.prompt_ids
        chunk = ids[seq.prefilled : seq.prefilled + budget]
        t0 = time.monotonic()
        logits = self._runner.prefill(seq.slot, chunk, seq.prefilled)
        self.listener.on_step(1, time.monotonic() - t0, "prefill")
        self.listener.on_iteration_tokens(len(chunk))
        seq.prefilled += len(chunk)
        seq.length = seq.prefilled
        if seq.prefilled < len(ids):
            return len(chunk)
        seq.prefill_done_at = time.monotonic()
        with self._lock:
            self._prefilling = None
            self._running.append(seq)
        self._keep_prompt_blocks(seq)
        token = self._sample(logits.unsqueeze(0), [seq])[0]
        self._emit(seq, token)
        return len(chunk)

    def _keep_prompt_blocks(self, seq: _Sequence) -> None:
        if self.prefix is not None and seq.block_hashes:
            seq.held += self.prefix.keep(seq.block_hashes, seq.cached, seq.slot)

    def _keep_all_blocks(self, seq: _Sequence) -> None:
        if self.prefix is not None:
            tokens = (seq.req.prompt_ids + seq.output_ids)[: seq.length]
            self.prefix.finish(tokens, seq.req.cache_salt, seq.req.public_prefix_tokens, seq.slot, seq.cached,
                               seq.held)
            seq.held = []

    def _decode_step(self) -> None:
        batch = self._running
        if self.spec is not None and self.spec.step(self, batch):
            return
        t0 = time.monotonic()
        logits = self._runner.decode([s.last_token for s in batch], [s.length for s in batch])
        for s in batch:
            s.length += 1
        tokens = self._sample(logits, batch)
        step_s = time.monotonic() - t0
        self.listener.on_step(len(batch), step_s, "decode")
        self.listener.on_iteration_tokens(len(batch))
        for seq, token in zip(list(batch), tokens):
            self.listener.on_token(step_s)
            self._emit(seq, token)

    def _sample(self, logits: torch.Tensor, seqs: Sequence[_Sequence]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, seq in enumerate(seqs):
            p = seq.req.params
            out.append(greedy[i] if p.greedy else _sample_row(logits[i], p, seq.generator))
        return out

    def _emit(self, seq: _Sequence, token: int, held: str = "", send: bool = True) -> str:
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

    def _finish(self, seq: _Sequence, reason: str, delta: str = "") -> None:
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
                if self._prefilling is not None and self._prefilling.slot != len(self._running):
                    p = self._prefilling
                    self._runner.move_slot(p.slot, len(self._running), p.length)
                    p.slot = len(self._running)
            elif self._prefilling is seq:
                self._prefilling = None
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


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    x = logits.float() / max(p.temperature, 1e-5)
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
