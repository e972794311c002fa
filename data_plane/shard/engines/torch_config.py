"""The torch engine's configuration (its metrics hooks, StepListener, re-exported from step_listener.py).

    config = EngineConfig(dtype="float32", max_num_seqs=8)   # validated on construction
    engine = TorchEngine(config, listener=MyListener())       # a StepListener subclass

Imported by the engine's modules (torch_engine, torch_load, torch_output), by the shard
(data_plane/shard/engine_factory.py) and by the bench; it holds no behaviour beyond validation and
deriving the scheduler's part (`scheduler_config()`). A request's state inside the engine is sequence.SeqState.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.shard.engines.kv_cache import DEFAULT_BLOCK_SIZE
from data_plane.shard.engines.scheduler import SchedulerConfig
from data_plane.shard.engines.step_listener import StepListener
from data_plane.shard.engines.weight_source import DTYPE_CHOICES, KERNEL_CHOICES, QUANTIZATION_CHOICES

__all__ = ["DTYPES", "EngineConfig", "StepListener"]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Local HF folder or GGUF file; None = the default SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto (the fastest on this CPU: data_plane/shard/engines/weight_source.py), bfloat16, float16 or float32
    (batch-invariant greedy output)."""
    quantization: str = "auto"
    """Weight format (vLLM's flag): auto (what the model ships: a GGUF's Q4 blocks -> int4), none, int8, int4."""
    quantization_kernel: str = "auto"
    """What computes quantized projections: auto | blockq | torch (weight_source.resolve_plan)."""
    max_num_seqs: int = 16
    """Sequences decoded together (KV slots), 1..256."""
    max_model_len: int = 2048
    """Context window served (prompt + output), capped by the model's own."""
    prefill_chunk: int = 256
    """Prompt tokens processed per scheduler iteration, so long prompts don't stall decoding."""
    beside_prefill_share: float = 0.5
    """Share of prefill_chunk, 0..0.9, that waiting prompts of a chunked prefill's priority may take in its
    step (prefilled in the same pass, data_plane/shard/engines/scheduler.py); 0 = FIFO within a priority."""
    max_waiting: int = 256
    """Queue bound; beyond it new requests get 503 with Retry-After."""
    threads: int = 0
    """torch intra-op threads, 0..256; 0 = auto: all cores when adaptive, else all cores but one (at least 1)."""
    adaptive_threads: bool = True
    """Measure the decode step at 1 and at `threads` threads and keep the faster (data_plane/shard/engines/torch_threads.py);
    bf16/fp16 only: float32, the batch-invariant mode, keeps one fixed count."""
    prefix_caching: bool = True
    """Keep KV after requests end and reuse the longest cached prompt prefix."""
    prefix_cache_bytes: int = 0
    """Byte budget of the prefix cache; 0 = auto (1/16 of RAM, at most 1 GiB)."""
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per prefix-cache block, 1..1024 (the reuse granularity)."""
    speculation: str = "off"
    """ngram (prompt-lookup drafts verified in the decode pass, data_plane/shard/engines/torch_spec.py) or off."""
    num_speculative_tokens: int = 15
    """Most draft tokens per sequence and step, 1..16 (15: a 16-row verify pass costs ~1.2x a decode step
    on a CPU, a 17th row another ~4 ms: docs/BENCHMARKS.md); each sequence drafts what pays (SeqSpec)."""
    spec_max_batch: int = 4
    """No drafting while more sequences than this run, 1..256 (measured: docs/BENCHMARKS.md)."""
    jump_forward: bool = True
    """Constrained sequences draft the tokens their grammar forces, verified in one pass, speculation on
    or off (SchedulerConfig.jump_forward; docs/STRUCTURED.md)."""
    pipeline_parallel_size: int = 1
    """Stage processes the model's layers are split over, 1..64 (data_plane/shard/engines/pipeline.py)."""
    pipeline_layers: str | None = None
    """Where stages 1.. start, e.g. "10,20" (None: an even split)."""
    pipeline_stage_timeout_s: float = 1.0
    """A stage whose heartbeat stood still this long is lost (0.2..60 s): the shard fails its streams and exits."""
    pipeline_microbatches: int = 0
    """Micro-batches a pass that goes alone is split into, in flight at once through the stages, 0..64
    (0: as many as stages; 1: whole). With the batch queue on, decode plans are not split (they overlap
    across steps instead)."""
    pipeline_batch_queue: int = 0
    """Scheduler plans in flight at once through the stages, 0..64 (vLLM's batch queue; 0: as many as
    stages; 1: each step waits for its pass): decoding sequences go in that many contiguous groups."""
    pipeline_host: str = "127.0.0.1"
    """Stage 0's address for its group (TCPStore and pipeline links): another host's stage must reach it."""
    pipeline_port: int = 0
    """The group's TCPStore port (0: a free one; set it when a stage joins from another host)."""
    pipeline_remote_stages: tuple[int, ...] = ()
    """Stages that join from elsewhere (`switchboard stage --join host:port --rank r`) instead of being
    started by stage 0."""

    def scheduler_config(self) -> SchedulerConfig:
        """What the engine's scheduler (data_plane/shard/engines/scheduler.py) plans with; a pipeline's
        batch queue holds as many plans in flight as stages unless set (1 without a pipeline)."""
        queue = (self.pipeline_batch_queue or self.pipeline_parallel_size) if self.pipeline_parallel_size > 1 else 1
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, prefill_chunk=self.prefill_chunk,
                               beside_share=self.beside_prefill_share, max_model_len=self.max_model_len,
                               jump_forward=self.jump_forward, batch_queue=queue)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.quantization_kernel not in KERNEL_CHOICES:
            raise ValueError(f"quantization_kernel must be one of {', '.join(KERNEL_CHOICES)}")
        if not 1 <= self.max_num_seqs <= 256:
            raise ValueError("max_num_seqs must be in 1..256")
        if not 16 <= self.max_model_len <= 131072:
            raise ValueError("max_model_len must be in 16..131072")
        if not 1 <= self.prefill_chunk <= 8192:
            raise ValueError("prefill_chunk must be in 1..8192")
        if not 0.0 <= self.beside_prefill_share <= 0.9:
            raise ValueError("beside_prefill_share must be in 0..0.9")
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
        if not 1 <= self.pipeline_parallel_size <= 64:
            raise ValueError("pipeline_parallel_size must be in 1..64")
        if not 0 <= self.pipeline_microbatches <= 64:
            raise ValueError("pipeline_microbatches must be in 0..64")
        if not 0 <= self.pipeline_batch_queue <= 64:
            raise ValueError("pipeline_batch_queue must be in 0..64")
        if not 0.2 <= self.pipeline_stage_timeout_s <= 60:
            raise ValueError("pipeline_stage_timeout_s must be in 0.2..60")
