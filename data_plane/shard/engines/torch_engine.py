"""The torch engine: continuous batching over a slot KV cache, on CPU.

    engine = TorchEngine(EngineConfig(model=None, dtype="bfloat16"))
    await engine.start()                     # loads the model (progress on stdout)
    async for out in engine.generate(req):   # see data_plane.shard.engines.base
        ...
    await engine.aclose()

One scheduler thread owns the model. Each iteration is schedule -> execute -> update, as in
vLLM v1's `EngineCore.step()`:

- `Scheduler.schedule()` (scheduler.py) plans the step as a value: aborted and expired requests
  leave, waiting ones are admitted by priority into free slots under the step's prompt-token
  budget (whole prompts, or one chunked prefill that prompts of its priority share and higher ones
  overtake or park), every decoding sequence gets its next-token row (or drafts: a verify step),
  and the slot moves that keep decoding sequences in slots 0..n-1;
- `Executor.execute()` (torch_executor.py) runs it: the moves, the cached prefixes copied in, one
  forward pass (llama_runner.py), the token choice (torch_sampling / speculation);
- `OutputProcessor.update()` (torch_output.py) moves each sequence's computed count, streams its
  text to its asyncio queue (stop strings, EOS, max_tokens) and finishes it (slot freed, prefix
  blocks kept), so the next plan reuses the slot. Requests join between steps.

A sequence has a status and one computed-token count (sequence.py); nothing else says where it is.
A pipelined shard runs the loop as a batch queue (batch_queue.py): up to N plans in flight.

Prefix caching (on by default, data_plane/shard/engines/kv_cache.py): at admission a request's longest cached
prefix (full 16-token blocks, chained digests salted with its `cache_salt`) is copied into its
slot and only the rest is prefilled; its prompt blocks are kept once prefilled and its output
blocks when it ends, so the next turn of a conversation computes only its new tokens. The
blocks a running sequence uses are referenced and never evicted.

Compute runs in that thread (torch releases the GIL inside ops) so the event loop stays
free to stream tokens and accept requests. Also here: torch_config (EngineConfig, StepListener),
torch_load (loading the model, the prefix cache and a pipeline's stages at start),
torch_spec + speculation (n-gram drafts), torch_prefix (the prefix cache on the slots),
torch_threads (adaptive intra-op threads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from data_plane.common.errors import InvalidRequest, Overloaded, PipelineStageLost
from data_plane.shard.engines.base import (
    FINISH_ABORT,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    TextStream,
    check_lengths,
)
from data_plane.shard.engines.batch_queue import BatchQueue
from data_plane.shard.engines.chat_tokens import encode_chat
from data_plane.shard.engines.grammar import GrammarCompiler, GrammarError
from data_plane.shard.engines.logits import RequestLogits
from data_plane.shard.engines.model_files import LoadPhases
from data_plane.shard.engines.scheduler import Scheduler, SchedulerOutput
from data_plane.shard.engines.sequence import SeqState
from data_plane.shard.engines.token_masks import MaskPrefetch
from data_plane.shard.engines.torch_config import DTYPES, EngineConfig, StepListener
from data_plane.shard.engines.torch_executor import Executor
from data_plane.shard.engines.torch_load import (
    build_prefix,
    llguidance_tokenizer,
    load_model,
    ready_line,
    start_pipeline,
)
from data_plane.shard.engines.torch_output import OutputProcessor
from data_plane.shard.engines.torch_prefix import SlotPrefix
from data_plane.shard.engines.torch_sampling import Draws
from data_plane.shard.engines.torch_spec import Speculator
from data_plane.shard.engines.torch_threads import ThreadTuner
from data_plane.shard.kv_transcript import GeneratedTokens

# Re-exported: the shard, the bench and tests import these from here.
__all__ = ["DTYPES", "EngineConfig", "StepListener", "TorchEngine"]

log = logging.getLogger(__name__)


class TorchEngine:
    prompt_logprobs = True
    """Computes SamplingParams.prompt_logprobs (prompt_logprobs.py); other engines do not."""

    def __init__(self, config: EngineConfig, listener: StepListener | None = None) -> None:
        self.config = config
        self.listener = listener or StepListener()
        self.model_name = "unloaded"
        self.system_fingerprint = ""  # known once loaded (torch_load.py): fingerprint.py
        self.max_model_len = config.max_model_len
        self._runner: Any = None
        self._tokenizer: Any = None
        self._eos: set[int] = set()
        self._by_id: dict[str, SeqState] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None
        self.prefix: SlotPrefix | None = None
        self.thread_tuner: ThreadTuner | None = None  # adaptive intra-op threads, set at load
        self.grammars: GrammarCompiler | None = None  # constrained decoding (engines/grammar.py), set at load
        self.vocab_size = 0
        self.load_phases = LoadPhases()  # where start-up went (bench coldstart, the ready line)
        self.transcripts = GeneratedTokens()
        self.scheduler = Scheduler(
            config.scheduler_config(), prefix=self._cached_prefix,
            drafter=(Speculator(config.num_speculative_tokens, config.spec_max_batch,
                                on_probe=self.listener.on_spec_cost_probe)
                     if config.speculation == "ngram" else None))
        self.pipeline: Any = None  # a PipelineGroup (pipeline.py) when pipeline_parallel_size > 1
        self.on_dead: Callable[[], None] | None = None  # the shard's exit when a pipeline stage is lost
        self._executor: Executor | None = None  # set once the model is loaded
        self._output: OutputProcessor | None = None
        self._queue: BatchQueue | None = None  # a pipeline's batch queue (batch_queue.py), set at load

    @property
    def spec(self) -> Speculator | None:
        """The n-gram speculator the scheduler drafts with (None: speculation off; settable)."""
        return self.scheduler.drafter  # type: ignore[return-value]

    @spec.setter
    def spec(self, value: Speculator | None) -> None:
        self.scheduler.drafter = value

    # What the engine's tests and listeners read (the scheduler owns the state).
    @property
    def _prefilling(self) -> SeqState | None:
        return self.scheduler.chunked()

    @property
    def _parked(self) -> list[SeqState]:
        return self.scheduler.parked()

    @property
    def _running(self) -> list[SeqState]:
        return self.scheduler.decoding()

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the scheduler thread, then return once it is ready (its error, if any).

        Every torch op of the engine runs on that one thread, the load and warm-up included: each
        thread that runs a parallel op keeps its own OpenMP team, and once a process holds more
        OpenMP threads than cores, libgomp stops spinning between parallel regions (it throttles the
        spin-wait), so every small op of a step pays a futex wake-up. Measured here (2 cores, bf16, 2
        threads, batch 1): a decode step took 40 ms with the model loaded on another thread and 23 ms
        with everything on one (1 thread: 35 ms either way).
        """
        self._loop = loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if ready.done():
                return
            if exc is None:
                ready.set_result(None)
            else:
                ready.set_exception(exc)

        def scheduler() -> None:
            try:
                self._load()
            except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
                loop.call_soon_threadsafe(settle, exc)
                return
            loop.call_soon_threadsafe(settle, None)
            self._run()

        self._thread = threading.Thread(target=scheduler, name="engine-scheduler", daemon=True)
        self._thread.start()
        await ready

    def _load(self) -> None:
        """Load the model (torch_load.py), then wire the executor, the output processor and the batch
        queue to it and run one warm-up pass."""
        phases = self.load_phases = LoadPhases()
        model = load_model(self.config, self.listener, phases)
        self.weight_plan, self.thread_tuner = model.plan, model.thread_tuner
        self._runner, self._tokenizer, self._eos = model.runner, model.tokenizer, set(model.eos)
        self.model_name, self.vocab_size, self.max_model_len = model.name, model.vocab_size, model.max_model_len
        self.system_fingerprint = model.fingerprint
        # llguidance's token table takes ~0.6 s to build: in the compiler's pool, while the shard serves.
        self.grammars = GrammarCompiler.lazy(lambda: llguidance_tokenizer(self._tokenizer), listener=self.listener)
        self.prefix = build_prefix(self.config, model, self.listener)
        phases.mark("prefix_cache")
        if model.layer_ranges:
            self.pipeline = start_pipeline(self.config, model, self.prefix, self.listener, self._stage_lost)
            phases.mark("pipeline_stages")
        self._assemble()
        # One tiny warm-up pass so the first request doesn't pay for lazy kernel setup.
        self._runner.prefill(0, [self._tokenizer.bos_token_id or 1], 0)
        self._runner.decode([1], [1])
        phases.mark("warm_up")
        print(ready_line(model, self.config, self.prefix, phases), flush=True)

    def _assemble(self) -> None:
        """The step loop's parts around the loaded runner, tokenizer and prefix cache (tests assemble
        an engine around a fake runner this way: tests/data_plane/test_engine_step.py)."""
        self.scheduler.max_model_len = self.max_model_len
        self._executor = Executor(self._runner, self.prefix, MaskPrefetch(self.listener))
        self._output = OutputProcessor(self.scheduler, self._lock, self._by_id, self.listener, self.transcripts,
                                       self._decode_ids, self._eos, self.max_model_len, self.prefix)
        if self.pipeline is not None:  # each final output carries its stages' part (the shard's spans)
            self._output.stage_spans = self._runner.downstream.take
        if self.scheduler.config.batch_queue > 1:
            self._queue = BatchQueue(self._plan, self.scheduler, self._executor, self._output, self._lock,
                                     self._observe, self.listener)

    def _stage_lost(self, stage: int, why: str) -> None:
        """A stage is gone (the monitor thread): fail every open stream now (an error event the
        gateway resumes on another shard), then the shard leaves membership and exits (on_dead)."""
        if self.dead is None:
            self.dead = RuntimeError(f"pipeline stage {stage} lost: {why}")
        self._fail_open("a pipeline stage of the shard failed", PipelineStageLost)
        if self.on_dead is not None:
            self.on_dead()

    async def aclose(self) -> None:
        self._stop = True
        self._wake.set()
        if self.grammars is not None:
            self.grammars.close()
        # A lost stage can leave the scheduler thread in a receive for good: no join then.
        if self._thread is not None and (self.pipeline is None or self.dead is None):
            await asyncio.to_thread(self._thread.join, 10)
        if self._executor is not None and self._executor.masks is not None:
            self._executor.masks.close()
        if self.pipeline is not None:
            self.pipeline.close()

    # -- API ---------------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]], continue_final: bool = False) -> list[int]:
        """A message's text spelling a control token stays text (chat_tokens.py: it opened real turns)."""
        return encode_chat(self._tokenizer, messages, add_generation_prompt=not continue_final,
                           continue_final=continue_final)

    def encode_text(self, text: str, first: bool = True) -> list[int]:
        """A raw prompt's text as it is (the legacy Completions API), the tokenizer's special tokens first
        when it adds any and the text is not after token ids (`first`), as vLLM encodes a prompt."""
        return list(self._tokenizer.encode(text, add_special_tokens=first))

    def restore_generated(self, messages: Sequence[dict[str, str]], ids: list[int], salt: str | None) -> list[int]:
        """`ids` with earlier replies this shard generated put back as the tokens it generated
        (their re-tokenization may differ, which would end a prefix-cache hit there)."""
        out, restored = self.transcripts.splice(messages, ids, salt, self.encode_chat)
        if restored:
            self.listener.on_tokens_restored(restored)
        return out

    def stats(self) -> EngineStats:
        with self._lock:
            holders = self.scheduler.holders
            running = len(holders)
            waiting = self.scheduler.num_waiting
            used = sum(s.num_computed_tokens for s in holders)
        cap = self.config.max_num_seqs * self.max_model_len
        pc = self.prefix.cache if self.prefix else None
        return EngineStats(running=running, waiting=waiting, kv_usage=used / cap, max_num_seqs=self.config.max_num_seqs,
                           prefix_cache_blocks=pc.used_blocks if pc else 0,
                           prefix_cache_block_bytes=pc.block_bytes if pc else 0,
                           prefix_cache_capacity_bytes=pc.capacity_bytes if pc else 0)

    async def prepare(self, req: GenerationRequest) -> None:
        """Before `generate`: compile the request's grammar off the scheduler thread (cached by digest;
        raises grammar.GrammarError for one refused), advance it past a resumed stream's output, and check
        its logit_bias token ids."""
        bad = [t for t, _ in req.params.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"Invalid key in 'logit_bias': {bad[0]}. Maximum value is {self.vocab_size - 1}.",
                                 param="logit_bias")  # OpenAI's words
        if req.params.grammar is not None and req.grammar is None:
            assert self.grammars is not None, "prepare() before the model is loaded"
            req.grammar = await self.grammars.compile(req.params.grammar)
            if req.resumed_text:  # a resumed stream: the grammar continues after what was sent
                kind = req.params.grammar.kind.value
                try:
                    req.grammar = req.grammar.resumed(req.resumed_text)
                except GrammarError:
                    self.listener.on_grammar_resume(kind, "rejected")
                    raise
                self.listener.on_grammar_resume(kind, "resumed")

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Validate and enqueue `req` now (raising 4xx/503 errors before any compute);
        return the iterator of its outputs. Closing the iterator early aborts the request.
        A request with a grammar must have been through `prepare`."""
        if self.dead is not None:
            raise Overloaded("the engine has failed; this shard is restarting", retry_after=5)
        max_tokens = check_lengths(len(req.prompt_ids), req.params.max_tokens, self.max_model_len)
        if req.params.grammar is not None and req.grammar is None:
            raise InvalidRequest("a constrained request was not prepared (its grammar is not compiled)")
        queue: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        loop = self._loop or asyncio.get_running_loop()
        # a resumed stream's output already sent (the prompt ends with it): counted as output, as unbroken
        made = len(self._tokenizer.encode(req.resumed_text, add_special_tokens=False)) if req.resumed_text else 0
        made = min(made, len(req.prompt_ids))
        proc = req.processor = RequestLogits.build(req.params, req.grammar, sorted(self._eos), req.prompt_ids,
                                                   self.vocab_size, self.listener, made)

        def sink(out: GenerationOutput | BaseException) -> None:
            if proc is not None and req.params.logprobs and isinstance(out, GenerationOutput):
                out = dataclasses.replace(out, logprobs=proc.drain())  # this output's tokens (scheduler thread)
            if isinstance(out, GenerationOutput) and seq.prompt_logprobs is not None:  # the first output's
                out, seq.prompt_logprobs = dataclasses.replace(out, prompt_logprobs=tuple(seq.prompt_logprobs)), None
            loop.call_soon_threadsafe(queue.put_nowait, out)

        draws = None
        if not req.params.greedy:  # a resumed stream samples on from the position after the text already sent
            draws = Draws(req.params.seed, offset=made)
        stream = TextStream(self._decode_ids, req.params.stop, max(0, req.params.min_tokens - made))  # made: sent
        seq = SeqState(req=req, max_tokens=max_tokens, sink=sink, stream=stream, draws=draws)
        if self.prefix is not None:
            seq.block_hashes = self.prefix.hashes(req.prompt_ids, req.cache_salt, req.public_prefix_tokens)
        with self._lock:
            if self.dead is not None:  # it died while this request was being prepared
                raise Overloaded("the engine has failed; this shard is restarting", retry_after=5)
            if self.scheduler.num_waiting >= self.config.max_waiting:
                raise Overloaded("the shard's queue is full; retry shortly", retry_after=1)
            if req.request_id in self._by_id:
                raise Overloaded("a request with this id is already running", code="duplicate_request_id")
            self._by_id[req.request_id] = seq
            self.scheduler.add(seq)
        self._wake.set()
        return self._outputs(seq, queue)

    async def _outputs(
        self, seq: SeqState, queue: asyncio.Queue[GenerationOutput | BaseException]
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
                self.scheduler.abort(request_id)
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
            if self._queue is not None:  # a pipeline's passes in flight come back before it is closed
                self._queue.drain()
        except BaseException as exc:  # a dead engine fails every request, loudly, and the shard goes
            stage_gone = self.pipeline is not None and isinstance(exc, ConnectionError)
            if stage_gone:
                # A stage that died or froze (kill -9, OOM, a cut link) ends its link here, often before the
                # monitor's own line: an expected event, one line, no traceback (runbook: PipelineStageDown).
                log.error("engine stopped: %s; the shard fails its streams and exits (a pipeline stage is gone)",
                          exc)
            else:
                log.exception("engine scheduler died")
            with self._lock:  # generate() checks under it too: no request slips in after the snapshot
                self.dead = exc
            if stage_gone:
                self._fail_open("a pipeline stage of the shard failed", PipelineStageLost)
            else:
                self._fail_open("the shard's engine failed")
            if self.on_dead is not None:  # leave membership and exit, to be restarted (group_exit.py)
                self.on_dead()

    def _fail_open(self, message: str, error: type[Overloaded] = Overloaded) -> None:
        """End every open stream with a retryable error (any thread): the gateway resumes it elsewhere."""
        with self._lock:
            seqs = list(self._by_id.values())
        for seq in seqs:
            seq.sink(error(message, retry_after=1))

    def _cached_prefix(self, seq: SeqState) -> int:
        """Prompt tokens the prefix cache holds for `seq` (leaving at least one to compute); none for a request
        asking prompt logprobs (a cached prefix has no logits: prompt_logprobs.py)."""
        if self.prefix is None or not seq.block_hashes or seq.req.params.prompt_logprobs is not None:
            return 0
        return self.prefix.cached_tokens(seq.block_hashes, len(seq.req.prompt_ids))

    def _plan(self) -> SchedulerOutput:
        """The next plan, and what must surround schedule(): the KV tier's offered blocks inserted
        before it (outside the lock: an insert copies blocks, and a pipeline sends them on; schedule()
        runs only once no offer is left, so a request enqueued after its offer sees its blocks); the
        admitted sequences' prefix hits referenced right after it, before the sequences it reaped are
        finished (storing their blocks may evict unreferenced ones: a counted hit among them would be
        gone by its load); the admissions recorded and the pass's thread count chosen."""
        executor, output, tuner, prefix = self._executor, self._output, self.thread_tuner, self.prefix
        assert executor is not None and output is not None
        while True:
            if prefix is not None:
                prefix.take_offers()
            with self._lock:
                if prefix is None or not prefix.has_offers:
                    plan = self.scheduler.schedule(time.time())
                    break
        executor.reserve(plan)
        for seq in plan.finished:
            output.finish(seq, FINISH_ABORT)
        if plan.rows:
            output.admit(plan)
            if tuner is not None:  # prefill passes run at the chosen thread count, never at a probed one
                if plan.is_decode:
                    tuner.for_decode()
                else:
                    tuner.for_other()
        return plan

    def _step(self) -> bool:
        """One iteration: schedule -> execute -> update; returns False when there was nothing to do."""
        if self._queue is not None:
            return self._queue.step()
        executor, output = self._executor, self._output
        assert executor is not None and output is not None
        plan = self._plan()
        if not plan.rows:
            return bool(plan.finished)
        result = executor.execute(plan)
        output.update(plan, result)
        self._observe(plan, result.seconds)
        return True

    def _observe(self, plan: SchedulerOutput, seconds: float) -> None:
        """A decode or verify pass's cost, for the speculator's and the thread tuner's models."""
        spec, tuner = self.spec, self.thread_tuner
        if plan.is_decode and spec is not None:
            if plan.is_verify:
                spec.observe_verify(len(plan.rows), plan.num_tokens, seconds)
            else:
                spec.observe_plain(len(plan.rows), seconds)
        if tuner is not None and plan.is_decode:  # a verify pass has more rows than a decode step: no sample
            tuner.observe(len(plan.rows), seconds, comparable=not plan.is_verify)
