"""The torch engine's configuration, per-sequence state and metrics hooks.

    config = EngineConfig(dtype="float32", max_num_seqs=8)   # validated on construction
    engine = TorchEngine(config, listener=MyListener())       # a StepListener subclass

Imported by the engine's modules (torch_engine, torch_output), by the shard
(data_plane/shard/app.py) and by the bench; it holds no behaviour beyond validation. A request's
state inside the engine is sequence.SeqState.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from data_plane.shard.engines.kv_cache import DEFAULT_BLOCK_SIZE
from data_plane.shard.engines.weight_source import DTYPE_CHOICES, QUANTIZATION_CHOICES

if TYPE_CHECKING:
    from data_plane.shard.engines.pipeline import PassTiming

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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}")
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


class StepListener:
    """Hooks the shard's metrics into the scheduler (called from the engine thread)."""

    def on_step(self, batch_size: int, step_s: float, kind: str) -> None: ...

    def on_first_token(self, seq_ttft_s: float, prefill_s: float | None = None) -> None:
        """A sequence's first token, `seq_ttft_s` after it reached the engine; `prefill_s`: its prompt's prefill
        time, reported here (not at the request's end) so the prefill and TTFT histograms move together."""

    def on_token(self, itl_s: float) -> None: ...

    def on_admit(self, queue_s: float) -> None: ...

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None: ...

    def on_kv_evict(self, reason: str, blocks: int) -> None: ...

    def on_kv_block_evicted(self, lifetime_s: float, idle_s: float) -> None:
        """A prefix-cache block evicted for capacity: seconds since stored, and since last used."""

    def on_kv_block_reused(self, gap_s: float) -> None:
        """A cached prefix-cache block used again, `gap_s` after its previous use."""

    def on_tokens_restored(self, replies: int) -> None: ...

    def on_iteration_tokens(self, tokens: int) -> None: ...

    def on_spec_draft(self, drafted: int, accepted: int) -> None: ...

    def on_spec_cost_probe(self, kind: str) -> None:
        """A decode step run to re-measure the verify row cost: `plain` or `verify` (torch_spec.py)."""

    def on_prefill_beside(self, prompts: int) -> None:
        """`prompts` waiting prompts were prefilled beside a chunked prefill of their priority, in its pass."""

    def on_weights(self, dtype: str, dtype_reason: str, quantization: str, quantization_reason: str,
                   weight_bytes: int) -> None:
        """The model is loaded in this dtype and weight format, chosen for that reason (weight_source.WeightPlan)."""

    def on_threads(self, threads: int, reason: str) -> None:
        """The intra-op thread count is now `threads` (reason ``start`` or ``probe``: torch_threads.ThreadTuner)."""

    def on_stage(self, stage: int, up: bool) -> None:
        """A pipeline stage (0..N-1) joined (`up`) or was lost (data_plane/shard/engines/pipeline.py)."""

    def on_pipeline_pass(self, timing: PassTiming) -> None:
        """One forward pass through every pipeline stage: each stage's compute, each hop's time and bytes."""

    def on_batch_sent(self, in_flight: int, decode: bool) -> None:
        """A pipeline's batch queue sent a plan (batch_queue.py): plans in flight, itself included."""

    def on_grammar_compile(self, kind: str, seconds: float, outcome: str) -> None:
        """A grammar compile ended (engines/grammar.py): outcome compiled, cache_hit or a refusal reason."""

    def on_grammar_resume(self, kind: str, outcome: str) -> None:
        """A resumed stream's grammar was advanced over the output already sent (``resumed``) or refused it
        (``rejected``)."""

    def on_grammar_mask(self, rows: int, seconds: float) -> None:
        """A step's grammar bitmasks for `rows` constrained sequences were filled and applied in `seconds`."""

    def on_preempt(self, kind: str) -> None:
        """A priority preemption: ``prefill`` (a chunked prefill parked for a higher-priority prompt)
        or ``decode`` (a decode pass skipped while a higher-priority prompt is prefilled)."""
