"""Loading the torch engine's model: what `TorchEngine.start` builds on its scheduler thread.

    phases = LoadPhases()
    model = load_model(config, listener, phases)        # plan, threads, tokenizer, runner, EOS ids
    prefix = build_prefix(config, model, listener)     # the prefix cache on the runner's slots, or None
    group = start_pipeline(config, model, prefix, listener, on_lost)   # stages 1..N-1, when N > 1
    print(ready_line(model, config, prefix, phases))

The engine (data_plane/shard/engines/torch_engine.py) calls these in that order on the one thread
that runs every torch op (why: `TorchEngine.start`), then wires its executor and output processor
to the result. The loaded pieces are a `LoadedModel` value; nothing here holds state between loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from data_plane.common.cores import usable_cores
from data_plane.shard.engines.fingerprint import Numerics, model_digest
from data_plane.shard.engines.model_files import LoadPhases
from data_plane.shard.engines.step_listener import StepListener
from data_plane.shard.engines.torch_config import DTYPES, EngineConfig
from data_plane.shard.engines.torch_prefix import SlotPrefix
from data_plane.shard.engines.torch_threads import HostCpu, ThreadTuner

if TYPE_CHECKING:
    from data_plane.shard.engines.llama_runner import LlamaRunner
    from data_plane.shard.engines.pipeline import AloneThreads, PipelineGroup
    from data_plane.shard.engines.weight_source import WeightPlan


def auto_threads(adaptive: bool = True) -> int:
    """Intra-op threads when none are configured. Adaptive (the default): every core, the
    `ThreadTuner` (data_plane/shard/engines/torch_threads.py) dropping to one thread while another
    process holds a core. Fixed: every core but one, which the event loop (streaming, HTTP) needs
    beside the scheduler thread; N fixed threads on N cores collapse when any other process runs
    (2 cores, streamed: 2.9 tok/s against 25 at 1 thread; 38 against 26 when the host is idle)."""
    cores = usable_cores()  # affinity and cgroup quota, not the host
    return cores if adaptive else max(1, cores - 1)


def llguidance_tokenizer(tokenizer: Any) -> Any:
    """llguidance's token table for `tokenizer` (~0.6 s to build: the grammar compiler's pool builds it)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


@dataclass(frozen=True)
class LoadedModel:
    """What `load_model` resolved and loaded."""

    runner: LlamaRunner
    """The forward pass and its slot KV cache (stage 0's layers when pipelined)."""
    tokenizer: Any
    """The model's HF tokenizer (chat template, decode)."""
    plan: WeightPlan
    """The dtype and weight format served, and why (data_plane/shard/engines/weight_source.py)."""
    threads: int
    """Intra-op threads at start (the tuner's upper bound when adaptive)."""
    thread_tuner: ThreadTuner | None
    """Adaptive intra-op threads, started; None when the count is fixed."""
    alone: AloneThreads | None
    """A pipeline: the threads a pass alone in it runs at now, chosen by `thread_tuner` (None: fixed)."""
    name: str
    """The served model name (the OpenAI `model` field)."""
    path: str
    """Where the model was read from (the prefix cache's model id)."""
    eos: frozenset[int]
    """Token ids that end a reply: the config's and the tokenizer's."""
    vocab_size: int
    max_model_len: int
    """The configured context window capped by the model's own."""
    num_layers: int
    layer_ranges: list[tuple[int, int]] | None
    """Each pipeline stage's layers (None: one process)."""
    started: float
    """time.monotonic() once threads were set, before the weights: the ready line's clock."""
    fingerprint: str = ""
    """The shard's `system_fingerprint`: what decides its numerics, named (fingerprint.py)."""


def load_model(config: EngineConfig, listener: StepListener, phases: LoadPhases) -> LoadedModel:
    """Resolve the weight plan, set the intra-op threads, read config and tokenizer and load stage 0's
    weights (marking `phases`)."""
    from data_plane.model_store import model_source, served_name
    from data_plane.shard.engines.llama_runner import LlamaRunner
    from data_plane.shard.engines.model_files import load_tokenizer, read_config
    from data_plane.shard.engines.weight_source import CpuCaps, DtypeReason, resolve_plan

    source = model_source(config.model)
    caps = CpuCaps.detect()
    plan = resolve_plan(config.dtype, config.quantization, source=source.kind, caps=caps,
                        kernel=config.quantization_kernel)
    # float32 asked for (or the exact kernel by name) is the batch-invariant mode: its numerics must not
    # depend on when a probe switches threads (float32 that auto chose, for a CPU without native bf16,
    # adapts like bf16).
    pinned = plan.dtype_reason in (DtypeReason.REQUESTED, DtypeReason.EXACT_KERNEL)
    adaptive = config.adaptive_threads and not (plan.dtype == "float32" and pinned)
    # A pipeline: `threads` is each stage's (auto: the cores over the stages on this host); together
    # they hold that many cores each, which a pass alone in the pipeline may use (PipelineSpec.alone_threads).
    local_stages = config.pipeline_parallel_size - len(config.pipeline_remote_stages)
    threads = config.threads or max(1, auto_threads(adaptive) // local_stages)
    shared = min(threads * local_stages, usable_cores()) if config.pipeline_parallel_size > 1 else 0
    torch.set_num_threads(threads)
    host = HostCpu()  # what the other processes keep busy while this one loads: the tuner's first count
    started = time.monotonic()
    path = source.path
    print(f"[switchboard] loading model from {source.gguf if plan.quantization != 'none' and source.gguf else path} "
          f"({plan.describe()})...", flush=True)
    hf_config = read_config(path)
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(path))
    max_model_len = min(config.max_model_len, hf_config.max_position_embeddings)
    phases.mark("plan_and_config")
    tokenizer = load_tokenizer(path)
    phases.mark("tokenizer")
    num_layers = int(hf_config.num_hidden_layers)
    ranges = None
    if config.pipeline_parallel_size > 1:
        from data_plane.shard.engines.pipeline import head_layers, split_layers

        c = hf_config
        head = head_layers(int(c.hidden_size), int(c.intermediate_size), int(c.num_attention_heads),
                           int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads), int(c.vocab_size))
        ranges = split_layers(num_layers, config.pipeline_parallel_size, config.pipeline_layers, head=head)
    runner = LlamaRunner.from_pretrained(
        path, dtype=DTYPES[plan.dtype], max_num_seqs=config.max_num_seqs, max_len=max_model_len,
        plan=plan, gguf=source.gguf, layer_range=ranges[0] if ranges else None)
    phases.mark("weights")
    tuner = None
    alone = None
    if shared and adaptive and shared > threads:
        # A pipeline: a pass alone in it runs on `shared` threads or on each stage's share (pipeline.Hops.pace),
        # the tuner choosing from those passes' times; the passes that overlap always at the share.
        from data_plane.shard.engines.pipeline import AloneThreads

        alone = AloneThreads(threads, shared)
        tuner = ThreadTuner(shared, alone.set, listener.on_threads,
                            initial=shared if host.idle_for(shared) else threads, min_threads=threads)
        tuner.start()
    elif shared:
        listener.on_threads(threads, "start")
    elif adaptive and threads > 1:
        tuner = ThreadTuner(threads, torch.set_num_threads, listener.on_threads,
                            initial=threads if host.idle_for(threads) else 1)
        tuner.start()
    else:
        listener.on_threads(threads, "start")
    listener.on_weights(plan.dtype, plan.dtype_reason.value, plan.quantization, plan.quantization_reason.value,
                        runner.weight_bytes, plan.kernel)
    eos = hf_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    name = served_name(config.model)
    numerics = Numerics(engine="torch", model=name, digest=model_digest(path, source.gguf), dtype=plan.dtype,
                        quantization=plan.quantization, kernel=plan.kernel, weights=runner.weight_format,
                        packed=runner.packed, runtime=f"torch {torch.__version__} {caps.capability}")
    return LoadedModel(runner=runner, tokenizer=tokenizer, plan=plan, threads=threads, thread_tuner=tuner,
                       alone=alone,
                       name=name, path=str(path), eos=frozenset(eos_ids),
                       vocab_size=int(hf_config.vocab_size), max_model_len=max_model_len, num_layers=num_layers,
                       layer_ranges=ranges, started=started, fingerprint=numerics.fingerprint())


def build_prefix(config: EngineConfig, model: LoadedModel, listener: StepListener) -> SlotPrefix | None:
    """The prefix cache on the runner's slots (None: prefix caching off). With a pipeline, stage 0's
    blocks hash as the whole model's."""
    if not config.prefix_caching:
        return None
    return SlotPrefix.build(model.runner, model_id=model.path, dtype=model.plan.dtype,
                            block_size=config.kv_block_size, budget_bytes=config.prefix_cache_bytes,
                            on_evict=listener.on_kv_evict, on_block_evicted=listener.on_kv_block_evicted,
                            on_block_reused=listener.on_kv_block_reused, total_layers=model.num_layers)


def start_pipeline(config: EngineConfig, model: LoadedModel, prefix: SlotPrefix | None, listener: StepListener,
                   on_lost: Callable[[int, str], None]) -> PipelineGroup:
    """Stages 1..N-1 of a pipeline (data_plane/shard/engines/pipeline.py) behind the runner's forward;
    every stage serves the plan stage 0 resolved (the same dtype and weight format), and every copy
    between the prefix pool and a slot is repeated on each stage."""
    from data_plane.shard.engines.pipeline import PipelineGroup, PipelineSpec

    assert model.layer_ranges is not None, "start_pipeline() for a one-process model"
    spec = PipelineSpec(model=config.model or "", dtype=model.plan.dtype, quantization=model.plan.quantization,
                        kernel=model.plan.kernel_choice,
                        max_num_seqs=config.max_num_seqs, max_len=model.max_model_len,
                        ranges=tuple(model.layer_ranges), timeout_s=config.pipeline_stage_timeout_s,
                        threads=model.threads, alone_threads=model.alone.most if model.alone else 0,
                        prefix_blocks=prefix.cache.num_blocks if prefix else 0,
                        block_size=config.kv_block_size, microbatches=config.pipeline_microbatches,
                        host=config.pipeline_host, port=config.pipeline_port, remote=config.pipeline_remote_stages)
    group = PipelineGroup(spec, on_lost, listener.on_stage)
    hops = group.start(model.runner.hidden_size, model.runner.dtype)
    hops.on_pass = listener.on_pipeline_pass
    hops.on_kv = listener.on_pipeline_kv
    hops.alone = model.alone
    model.runner.downstream = hops
    if prefix is not None:
        prefix.cache.mirror = hops
    return group


def ready_line(model: LoadedModel, config: EngineConfig, prefix: SlotPrefix | None, phases: LoadPhases) -> str:
    """The shard's ready line: load time, KV and prefix cache sizes, threads, weights and where the time went."""
    runner, plan = model.runner, model.plan
    threads = f"1..{model.threads} threads (adaptive)" if model.thread_tuner else f"{model.threads} threads"
    if model.alone:
        threads = f"{model.threads} threads a stage, up to {model.alone.most} for a pass alone in the pipeline (adaptive)"
    return (f"[switchboard] model {model.name} ready in {time.monotonic() - model.started:.1f} s "
            f"(KV cache {runner.kv_cache_bytes / 2**20:.0f} MiB for "
            f"{config.max_num_seqs} x {model.max_model_len} tokens; prefix cache "
            f"{prefix.cache.capacity_bytes / 2**20 if prefix else 0:.0f} MiB; {threads}; "
            f"{plan.describe()}: {runner.weight_format}, {runner.weight_bytes / 2**20:.0f} MiB"
            f"{', oneDNN-packed' if runner.packed else ''}; fingerprint {model.fingerprint}; {phases.describe()})")
