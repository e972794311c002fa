"""The engine a shard serves, chosen by `--engine` and built from the shard's settings.

    engine = build_engine(settings, metrics)     # SyntheticEngine or TorchEngine, not started
    engine = build_engine(settings, None)        # no metrics listener (tests, benches)

`synthetic` needs no model; `torch` imports torch only here, when it is built; `vllm` is not built
in-process (its shard is vLLM's own server beside a sidecar: `engines/vllm_engine.py`). Called by the
shard's app (`app.py`, `create_app`) and by tests that build a shard's engine as its main does. A new
engine is added here (docs/ARCHITECTURE.md, "How to add … a shard engine").
"""

from __future__ import annotations

from data_plane.shard.engines.base import Engine
from data_plane.shard.metrics import MetricsListener, ShardMetrics
from data_plane.shard.settings import ShardSettings


def build_engine(settings: ShardSettings, metrics: ShardMetrics | None) -> Engine:
    """The engine `settings.engine` names, reporting to `metrics` (none when None)."""
    if settings.engine == "synthetic":
        from data_plane.shard.engines.synthetic import SyntheticEngine

        return SyntheticEngine(settings.max_model_len, settings.synthetic_token_delay_ms / 1000.0,
                               settings.max_num_seqs, MetricsListener(metrics) if metrics else None)
    if settings.engine == "vllm":
        raise ValueError("the vllm engine runs as vLLM's own server beside a sidecar (see data_plane.shard.engines.vllm_engine)")
    from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine

    config = EngineConfig(
        model=settings.model,
        dtype=settings.dtype,
        quantization=settings.quantization, quantization_kernel=settings.quantization_kernel,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        prefill_chunk=settings.prefill_chunk,
        beside_prefill_share=settings.beside_prefill_share,
        max_waiting=settings.max_waiting,
        threads=settings.threads,
        adaptive_threads=settings.adaptive_threads == "on",
        prefix_caching=settings.prefix_caching == "on",
        prefix_cache_bytes=settings.prefix_cache_bytes,
        kv_block_size=settings.kv_block_size,
        speculation=settings.speculation,
        num_speculative_tokens=settings.num_speculative_tokens,
        spec_max_batch=settings.spec_max_batch, jump_forward=settings.jump_forward,
        pipeline_parallel_size=settings.pipeline_parallel_size, pipeline_layers=settings.pipeline_layers,
        pipeline_stage_timeout_s=settings.pipeline_stage_timeout_s,
        pipeline_microbatches=settings.pipeline_microbatches, pipeline_batch_queue=settings.pipeline_batch_queue,
        **settings.pipeline_placement(),
    )
    return TorchEngine(config, MetricsListener(metrics) if metrics else None)
