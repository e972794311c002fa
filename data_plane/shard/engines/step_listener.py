"""The engine's hooks for the shard's metrics: a StepListener subclass gets each step, token, admission...

    class MyListener(StepListener):
        def on_step(self, batch_size, step_s, kind): ...
    engine = TorchEngine(config, listener=MyListener())

Its own module, without torch, so that the shard's metrics (data_plane/shard/metrics.py) import it and a
synthetic shard starts without paying torch's import (seconds); torch_config re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from data_plane.shard.engines.pipeline import PassTiming
    from data_plane.shard.engines.pipeline_kv import KVHop


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
                   weight_bytes: int, kernel: str = "torch") -> None:
        """The model is loaded in this dtype and weight format, chosen for that reason, computed by `kernel`
        (weight_source.WeightPlan)."""

    def on_threads(self, threads: int, reason: str) -> None:
        """The intra-op thread count is now `threads` (reason ``start`` or ``probe``: torch_threads.ThreadTuner)."""

    def on_stage(self, stage: int, up: bool) -> None:
        """A pipeline stage (0..N-1) joined (`up`) or was lost (data_plane/shard/engines/pipeline.py)."""

    def on_pipeline_pass(self, timing: PassTiming) -> None:
        """One forward pass through every pipeline stage: each stage's compute, each hop's time and bytes."""

    def on_pipeline_kv(self, op: KVHop, blocks: int, nbytes: int, seconds: float) -> None:
        """KV-tier blocks moved between stage 0 and the later stages (pipeline.Hops gather / insert)."""

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
