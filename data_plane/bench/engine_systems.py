"""The torch systems `switchboard bench engine` measures, and what every system is built from.

    config = BenchConfig(model=None, dtype="bfloat16", max_tokens=128, concurrency=(1, 16),
                         num_prompts=None, max_prompt_len=64, threads=0)
    system = SwitchboardSystem(config)        # or SpeculativeSystem, NaiveSystem
    await system.start(); results = await system.run(prompts, 16, 128); await system.aclose()

Used by data_plane/bench/engine.py (which runs each system in its own process) and by
data_plane/bench/engine_llamacpp.py (the llama.cpp system, on the same :class:`BenchConfig` and
:class:`System` protocol).

- switchboard: `TorchEngine` in-process, one asyncio task per worker consuming `generate`
  (switchboard-spec: the same with n-gram speculative decoding on).
- naive: HF `model.generate` one request at a time (what a minimal server does); requests
  queue behind each other, so at concurrency N the TTFT includes that queueing. EOS is ignored
  so every request yields exactly max-tokens.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from data_plane.bench.common import RequestResult, closed_loop, one_at_a_time


@dataclass(frozen=True)
class BenchConfig:
    model: str | None
    """--model: HF folder or GGUF; None = the default SmolLM2-135M-Instruct."""
    dtype: str
    """auto, bfloat16 or float32 for the torch systems; llama.cpp runs the GGUF's own quantisation."""
    max_tokens: int
    """Output tokens asked of every request."""
    concurrency: tuple[int, ...]
    """Closed-loop worker counts, one measurement each."""
    num_prompts: int | None
    """Requests per concurrency level; None = 2 x concurrency."""
    max_prompt_len: int
    """Longest prompt in tokens (sizes KV caches and batches)."""
    threads: int
    """torch / llama.cpp threads; 0 = all cores."""
    workload: str = "chat"
    """chat (open-ended PROMPTS) or quote (the reply repeats the prompt: data_plane/bench/engine_spec.py)."""
    spec_max_batch: int = 4
    """switchboard-spec: no drafting while more sequences than this run (EngineConfig.spec_max_batch)."""
    num_speculative_tokens: int = 15
    """switchboard-spec: most draft tokens per sequence and step, 1..16."""
    pipeline_parallel_size: int = 1
    """switchboard: stage processes (`--pipeline-parallel-size`), sharing `threads` between them."""
    pipeline_microbatches: int = 0
    """switchboard: micro-batches a pass that goes alone (`--pipeline-microbatches`; 0: as many as stages)."""
    pipeline_batch_queue: int = 0
    """switchboard: plans in flight across steps (`--pipeline-batch-queue`; 0: as many as stages; 1: off)."""
    quantization: str = "auto"
    """switchboard's weight format (--quantization: auto, none, int8, int4); naive HF always runs dense."""
    quantization_kernel: str = "auto"
    """switchboard's kernel for quantized projections (--quantization-kernel: auto, blockq, blockq_x2, blockq_exact, torch)."""

    @property
    def max_model_len(self) -> int:
        """Context each sequence needs, rounded up to 256 (the same for every system)."""
        return 256 * math.ceil((self.max_prompt_len + self.max_tokens + 8) / 256)

    def requests_at(self, concurrency: int) -> int:
        return self.num_prompts or 2 * concurrency


class System(Protocol):
    """One thing under test. `start` once, `run` once per concurrency level, then `aclose`."""

    weight_bytes: int
    dtype: str

    async def start(self) -> None: ...

    async def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestResult]: ...

    async def aclose(self) -> None: ...


class Skip(Exception):
    """The system cannot run here; the message says why and how to fix it."""


def rss_kib(pid: str) -> int:
    """VmRSS of process `pid` ("self" for this one) from /proc, KiB (0 where /proc has none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class SwitchboardSystem:
    """Our TorchEngine in-process; each closed-loop worker is an asyncio task."""

    speculation = "off"

    def __init__(self, config: BenchConfig) -> None:
        from data_plane.bench.engine_spec import AcceptanceCounter
        from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine

        self.dtype = config.dtype
        self.weight_bytes = 0
        self.counter = AcceptanceCounter()
        self.engine = TorchEngine(
            EngineConfig(
                model=config.model,
                dtype=config.dtype,
                quantization=config.quantization, quantization_kernel=config.quantization_kernel,
                max_num_seqs=min(256, max(config.concurrency)),
                max_model_len=config.max_model_len,
                # The same total cores whatever the split: each stage gets its share of the threads.
                threads=max(1, config.threads // config.pipeline_parallel_size),
                pipeline_parallel_size=config.pipeline_parallel_size,
                pipeline_microbatches=config.pipeline_microbatches,
                pipeline_batch_queue=config.pipeline_batch_queue,
                speculation=self.speculation,
                spec_max_batch=config.spec_max_batch,
                num_speculative_tokens=config.num_speculative_tokens,
            ),
            self.counter,
        )

    def spec_report(self) -> dict[str, Any]:
        """Acceptance since the last call (one concurrency level), and where the thread tuner stands."""
        out = self.counter.report()
        self.counter.reset()
        out["intra_op_threads"] = self.counter.threads
        out["thread_switches"] = self.counter.thread_switches
        return out

    async def start(self) -> None:
        await self.engine.start()
        runner, plan = self.engine._runner, self.engine.weight_plan  # type: ignore[attr-defined]
        self.weight_bytes = runner.weight_bytes
        self.resident_weight_bytes = runner.resident_weight_bytes
        self.dense_bf16_bytes = 2 * runner.weight_params
        # what auto resolved to, in the report (+a8: blockq's int8 activations, +a8x2: in two planes, +a32: its
        # exact path's float32 ones; an older tree's plan has no kernel, nor planes)
        acts = ("+a32" if getattr(plan, "exact", False) else "+a8x2" if getattr(plan, "planes", 1) == 2
                else "+a8" if getattr(plan, "blockq", False) else "")
        self.dtype = f"{plan.dtype}/{plan.quantization}{acts}"

    async def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestResult]:
        return await closed_loop(prompts, concurrency, partial(self._one, max_tokens))

    async def _one(self, max_tokens: int, ids: list[int]) -> RequestResult:
        from data_plane.shard.engines.base import GenerationRequest, SamplingParams

        r = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(ids))
        req = GenerationRequest(uuid.uuid4().hex, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        async for out in self.engine.generate(req):
            now = time.perf_counter()
            if r.first_token is None:
                r.first_token = now
            r.output_tokens = out.completion_tokens
        r.finished = time.perf_counter()
        return r

    def stage_rss_mb(self) -> list[float]:
        """Resident memory now of each pipeline stage process (stage 0: this process), MiB."""
        group = self.engine.pipeline
        pids = ["self"] + ([str(p.pid) for _, p in sorted(group.procs.items())] if group is not None else [])
        return [round(rss_kib(pid) / 1024, 1) for pid in pids]

    def stage_weights_mb(self) -> list[float]:
        """Weights resident in each pipeline stage (stage 0: with the embedding and head), MiB: a
        stage's memory less these (and its touched KV) is the fixed overhead of a process."""
        group = self.engine.pipeline
        sizes = [self.engine._runner.resident_weight_bytes]  # type: ignore[attr-defined]
        if group is not None:
            sizes += [int(info.get("weight_bytes", 0)) for _, info in sorted(group.stage_info.items())]
        return [round(b / 2**20, 1) for b in sizes]

    async def aclose(self) -> None:
        await self.engine.aclose()


class SpeculativeSystem(SwitchboardSystem):
    """The same engine with n-gram speculative decoding on (`--speculation on`)."""

    speculation = "ngram"


class NaiveSystem:
    """HF `generate`, one request at a time behind a FIFO lock, EOS ignored (min_new_tokens)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.dtype = config.dtype
        self.weight_bytes = 0
        self.dense_bf16_bytes = 0
        self.model: Any = None

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from data_plane.model_store import resolve_model
        from data_plane.shard.engines.torch_engine import DTYPES

        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan

        path = resolve_model(self.config.model)
        # Dense always; `auto` is the CPU's dense choice (bf16 where native, else fp32), as the shard's.
        self.dtype = resolve_plan(self.config.dtype, "none", source="dense", caps=CpuCaps.detect()).dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[self.dtype]).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.dense_bf16_bytes = 2 * sum(p.numel() for p in self.model.parameters())
        self._generate([1, 2, 3], 2, RequestResult(submitted=time.perf_counter()))  # warm-up

    async def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestResult]:
        return await one_at_a_time(prompts, concurrency, max_tokens, self._generate)

    def _generate(self, ids: list[int], max_tokens: int, r: RequestResult) -> None:
        import torch

        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),  # pad id == <|im_end|>: see FACTS.md
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.model.generation_config.pad_token_id,
                streamer=_timing_streamer(r),
            )
        r.finished = time.perf_counter()

    async def aclose(self) -> None:
        self.model = None


def _timing_streamer(r: RequestResult) -> Any:
    """A transformers streamer that stamps each new token into `r` (the first put is the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        prompt_seen = False
        last = 0.0

        def put(self, value: Any) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            now = time.perf_counter()
            if r.first_token is None:
                r.first_token = now
            else:
                r.itls.append(now - self.last)
            self.last = now
            r.output_tokens += int(value.numel())

        def end(self) -> None:
            pass

    return TimingStreamer()


__all__ = ["BenchConfig", "NaiveSystem", "Skip", "SpeculativeSystem", "SwitchboardSystem", "System"]
