"""Shard metrics: vLLM's names (so vLLM dashboards work), `switchboard_shard_*` for the rest.

    metrics = ShardMetrics(CollectorRegistry(), model_name="SmolLM2-135M-Instruct")
    metrics.request_success.labels(model_name=m, finished_reason="stop").inc()

Every metric carries `model_name` (vLLM's label); no label ever holds a request or user id. Names,
labels and buckets follow vLLM's ``vllm/v1/metrics/loggers.py`` where vLLM has the metric; what a vLLM
dashboard shows that cannot apply here is listed in docs/metrics.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.common.telemetry import E2E_BUCKETS, LATENCY_BUCKETS
from data_plane.shard.engines.base import Engine, EngineStats, GenerationOutput
from data_plane.shard.engines.step_listener import StepListener
from data_plane.shard.grammar_metrics import StructuredMetrics
from data_plane.shard.kv_metrics import KVTierMetrics
from data_plane.shard.spec_metrics import SpecMetrics

if TYPE_CHECKING:
    from data_plane.shard.engines.pipeline import PassTiming
    from data_plane.shard.engines.pipeline_kv import KVHop

ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
"""vLLM's request token-count buckets (1-2-5 steps)."""
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
"""vLLM's ``vllm:request_time_per_output_token_seconds`` buckets."""
KV_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                        1200, 1800)
"""vLLM's KV block residency buckets (lifetime, idle before eviction, reuse gap), seconds."""
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""vLLM's ``FinishReason`` values, the ``finished_reason`` label of ``vllm:request_success``."""
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""Where a prompt token's KV came from: computed here, this shard's prefix cache, the cache nodes."""
CACHED_SOURCES = ("device", "external_unspecified")
"""Where a cached prompt token's KV sat: the engine's own KV memory (``device``, host RAM on a CPU
engine), or the cache nodes (``external_unspecified``). vLLM's ``host``, ``p2p`` and ``disk`` tiers
do not exist here."""
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""vLLM's ``sleep_state`` label values of ``vllm:engine_sleep_state`` (sleep mode levels 1 and 2)."""
WAITING_REASONS = ("capacity",)
"""Why requests wait: for a batch slot. vLLM's ``deferred`` (waiting on a KV transfer) does not happen
here: a shard fetches KV from the cache nodes before it queues the request."""
REFUSED_ROUTES = ("chat", "debug_spans", "metrics")
"""``switchboard_shard_refused_total``'s route label (data_plane/common/hop_auth.py RefusalMetrics): the chat
API (completions and input token counts) without the cluster token, /debug/spans, /metrics."""


def finished_reason(reason: str | None) -> str:
    """An OpenAI finish reason as vLLM's bounded ``finished_reason`` (tool calls end as ``stop``)."""
    if reason in FINISHED_REASONS:
        return str(reason)
    if reason is None:
        return "abort"
    return "stop" if reason == "tool_calls" else "error"


class ShardMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch (incl. prefill).", m,
                             registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", m, registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (tokens held / capacity).", m,
                              registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival at the engine to first token.", m,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m,
                             buckets=ITL_BUCKETS, registry=registry)
        self.itl_legacy = Histogram("vllm:time_per_output_token_seconds", "Time between consecutive output tokens "
                                    "(vLLM's earlier name of vllm:inter_token_latency_seconds, same observations).",
                                    m, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish, per request.", m,
                             buckets=E2E_BUCKETS, registry=registry)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting for a slot.", m,
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Time in prefill, per request.", m,
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Time in decode, per request.", m,
                                     buckets=E2E_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens generated.", m,
                                         registry=registry)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       m + ["finished_reason"], registry=registry)
        self.shutdown_cuts = Counter(
            "switchboard_shard_shutdown_cuts", "Requests this shard's own shutdown cut because they outlived its "
            "grace (not a client leaving); the gateway resumes a cut stream on another shard.", registry=registry)
        self.waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                                       "Requests waiting, by reason (capacity: for a batch slot).",
                                       m + ["reason"], registry=registry)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: time from the first to the last output token / (output tokens - 1).", m,
                              buckets=TPOT_BUCKETS, registry=registry)
        self.prompt_by_source = Counter("vllm:prompt_tokens_by_source",
                                        "Prompt tokens of finished requests by where their KV came from "
                                        "(local_compute | local_cache_hit | external_kv_transfer: the cache nodes).",
                                        m + ["source"], registry=registry)
        self.cached_by_source = Counter("vllm:prompt_tokens_cached_by_source",
                                        "Cached prompt tokens of finished requests by tier (device: this shard's "
                                        "prefix cache; external_unspecified: fetched from the cache nodes).",
                                        m + ["source"], registry=registry)
        self.sleep_state = Gauge("vllm:engine_sleep_state", "The engine's sleep state, 1 for the state it is in "
                                 "(awake; a shard's engine never sleeps: weights_offloaded and discard_all stay 0).",
                                 m + ["sleep_state"], registry=registry)
        self.cache_config = Gauge("vllm:cache_config_info", "The engine's KV cache configuration (value 1).",
                                  ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "engine"],
                                  registry=registry)
        self.kv_block_lifetime = Histogram("vllm:kv_block_lifetime_seconds",
                                           "Prefix-cache blocks evicted for capacity: time from storing to eviction.",
                                           m, buckets=KV_RESIDENCY_BUCKETS, registry=registry)
        self.kv_block_idle = Histogram("vllm:kv_block_idle_before_evict_seconds",
                                       "Prefix-cache blocks evicted for capacity: time since their last use.", m,
                                       buckets=KV_RESIDENCY_BUCKETS, registry=registry)
        self.kv_block_reuse_gap = Histogram("vllm:kv_block_reuse_gap_seconds",
                                            "Time between consecutive uses of a prefix-cache block (a hit).", m,
                                            buckets=KV_RESIDENCY_BUCKETS, registry=registry)
        self._cache_described = False
        self.batch_size = Histogram("switchboard_shard_batch_size", "Sequences per engine step.",
                                    m + ["kind"], buckets=BATCH_BUCKETS, registry=registry)
        self.step_seconds = Histogram("switchboard_shard_step_seconds", "Engine step duration.", m + ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.rejected = Counter("switchboard_shard_requests_rejected", "Requests refused before compute.",
                                m + ["code"], registry=registry)
        self.ready = Gauge("switchboard_shard_ready", "1 once the model is loaded and serving.", m,
                           registry=registry)
        self.max_num_seqs = Gauge("switchboard_shard_max_num_seqs", "Configured batch capacity (slots).", m,
                                  registry=registry)
        # Pipeline parallelism (data_plane/shard/engines/pipeline.py); `stage` is a stage index 0..63.
        self.stage_up = Gauge("switchboard_shard_pipeline_stage_up", "1 while pipeline stage `stage` serves, 0 once lost.",
                              m + ["stage"], registry=registry)
        self.pass_seconds = Histogram("switchboard_shard_pipeline_pass_seconds", "One forward pass through every "
                                      "stage: stage 0 starting its layers to the last stage's rows back.",
                                      m, buckets=LATENCY_BUCKETS, registry=registry)
        self.stage_step = Histogram("switchboard_shard_pipeline_stage_step_seconds", "Stage `stage`'s compute in "
                                    "one pass (its layers; stage 0: the embedding too). 1 - its rate(_sum) / "
                                    "rate(pipeline_active_seconds) is the stage's idle (bubble) share.",
                                    m + ["stage"], buckets=LATENCY_BUCKETS, registry=registry)
        self.pipeline_active = Counter("switchboard_shard_pipeline_active_seconds", "Wall time with at least "
                                       "one pass in the pipeline (micro-batches overlap: not the sum of passes).",
                                       m, registry=registry)
        self.alone_passes = Counter("switchboard_shard_pipeline_alone_passes", "Passes sent into an empty "
                                    "pipeline, run by the stages on stage 0's host at every core they share "
                                    "(one stream's steps); the others run at each stage's share.", m,
                                    registry=registry)
        self.in_flight = Histogram("switchboard_shard_pipeline_passes_in_flight", "Passes (micro-batches) in "
                                   "flight when stage 0 sent each pass, itself included.", m,
                                   buckets=(1, 2, 3, 4, 6, 8, 16), registry=registry)
        self.steps_in_flight = Histogram("switchboard_shard_pipeline_steps_in_flight", "Scheduler plans in flight "
                                         "(the batch queue) when stage 0 sent each, itself included; `kind` "
                                         "decode or prefill.", m + ["kind"], buckets=(1, 2, 3, 4, 6, 8, 16),
                                         registry=registry)
        self.hop_latency = Histogram("switchboard_shard_pipeline_hop_latency_seconds", "Hop `stage` -> next stage "
                                     "(the last: back to stage 0): from the send to the receipt.",
                                     m + ["stage"], buckets=LATENCY_BUCKETS, registry=registry)
        self.hop_bytes = Counter("switchboard_shard_pipeline_hop_bytes", "Bytes stage `stage` sent to the next "
                                 "stage (the last: the wanted rows back to stage 0).", m + ["stage"], registry=registry)
        self.pipeline_kv_seconds = Histogram("switchboard_shard_pipeline_kv_seconds", "One KV-tier transfer "
                                             "between stage 0 and the later stages (`op` gather: a turn's blocks "
                                             "for the cache nodes; scatter: fetched blocks to the stages).",
                                             m + ["op"], buckets=LATENCY_BUCKETS, registry=registry)
        self.pipeline_kv_bytes = Counter("switchboard_shard_pipeline_kv_bytes", "KV-tier bytes moved between "
                                         "stage 0 and the later stages, by `op` (gather, scatter).", m + ["op"],
                                         registry=registry)
        # Prefix caching (vLLM's names, counted in tokens as vLLM does).
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      m, registry=registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m,
                                   registry=registry)
        self.prompt_tokens_cached = Counter("vllm:prompt_tokens_cached",
                                            "Prompt tokens of finished requests served from the prefix cache.", m,
                                            registry=registry)
        self.prefill_computed = Histogram("vllm:request_prefill_kv_computed_tokens",
                                          "Prompt tokens whose KV was computed (not cached), per request.", m,
                                          buckets=TOKEN_BUCKETS, registry=registry)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                               buckets=TOKEN_BUCKETS, registry=registry)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Output tokens per request.",
                                                   m, buckets=TOKEN_BUCKETS, registry=registry)
        self.request_max_tokens = Histogram("vllm:request_max_num_generation_tokens",
                                            "The output token limit (max_tokens) of each finished request.", m,
                                            buckets=TOKEN_BUCKETS, registry=registry)
        self.kv_evictions = Counter("switchboard_shard_prefix_cache_evictions",
                                    "Prefix-cache blocks evicted (capacity: LRU reuse under the byte budget) "
                                    "or not stored (no_space: every block referenced).", m + ["reason"],
                                    registry=registry)
        self.kv_blocks = Gauge("switchboard_shard_prefix_cache_blocks", "Blocks held by the prefix cache.", m,
                               registry=registry)
        self.kv_bytes = Gauge("switchboard_shard_prefix_cache_bytes", "Bytes of KV held by the prefix cache.", m,
                              registry=registry)
        self.kv_capacity = Gauge("switchboard_shard_prefix_cache_capacity_bytes",
                                 "The prefix cache's byte budget (0: prefix caching off).", m, registry=registry)
        self.tokens_restored = Counter(
            "switchboard_shard_transcript_tokens_restored",
            "Earlier replies in a prompt whose re-tokenization differed from the tokens this shard generated, "
            "put back as generated (else the prefix-cache hit would end there).", m, registry=registry)
        # Priority scheduling (data_plane/shard/engines/scheduler.py): vLLM's preemption counter, and ours by kind.
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted (a chunked prefill parked for a "
                                   "higher-priority prompt; its KV kept, resumed where it stopped).", m,
                                   registry=registry)
        self.priority_yields = Counter(
            "switchboard_shard_priority_preemptions",
            "Priority preemptions by kind: prefill (a chunked prefill parked for a higher-priority prompt), "
            "decode (a decode pass of lower tiers skipped while a higher tier's prompt is prefilled).",
            m + ["kind"], registry=registry)
        self.prefill_beside = Counter(
            "switchboard_shard_prefill_beside_chunk",
            "Waiting prompts prefilled beside a chunked prefill of their own priority, in its forward pass "
            "(the step's prefill budget shared, as vLLM's chunked prefill does; not FIFO behind the long one).",
            m, registry=registry)
        # Adaptive intra-op threads (data_plane/shard/engines/torch_threads.py).
        self.intra_op_threads = Gauge("switchboard_shard_intra_op_threads",
                                      "torch intra-op threads the decode step runs with now.", m, registry=registry)
        self.thread_switches = Counter(
            "switchboard_shard_thread_switches", "Changes of the intra-op thread count after a probe measured "
            "the other count faster (1 thread while another process holds a core).", m, registry=registry)
        self.thread_switches.labels(model_name)
        # The served dtype and weight format, and why (data_plane/shard/engines/weight_source.py: enums).
        self.weights_info = Gauge(
            "switchboard_shard_weights_info", "1 for the dtype and weight format served, with the reason each was "
            "chosen (dtype_reason: requested | native_bf16 | no_native_bf16 | quantized_kernel | exact_kernel | agreement; "
            "quantization_reason: "
            "requested | gguf_q4 | gguf_q8 | dense_model | dense_activations; kernel: torch | blockq_avx512_vnni | "
            "blockq_avx2 | blockq_portable | blockq_x2_<the same paths> | blockq_exact_<the same paths>).",
            [*m, "dtype", "dtype_reason", "quantization", "quantization_reason", "kernel"], registry=registry)
        self.weight_bytes = Gauge("switchboard_shard_weight_bytes", "Bytes of model weights a decode step reads.", m,
                                  registry=registry)
        # Series exist from the start (at 0), so rate() and the KV-reuse panels work before the first hit.
        for metric in (self.prefix_queries, self.prefix_hits, self.prompt_tokens_cached, self.prefill_computed,
                       self.request_prompt_tokens, self.request_generation_tokens, self.request_max_tokens,
                       self.tokens_restored, self.tpot, self.itl_legacy,
                       self.kv_block_lifetime, self.kv_block_idle, self.kv_block_reuse_gap):
            metric.labels(model_name)
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for source in PROMPT_SOURCES:
            self.prompt_by_source.labels(model_name, source)
        for source in CACHED_SOURCES:
            self.cached_by_source.labels(model_name, source)
        for reason in WAITING_REASONS:
            self.waiting_by_reason.labels(model_name, reason)
        for state in SLEEP_STATES:
            self.sleep_state.labels(model_name, state).set(1 if state == "awake" else 0)
        for reason in ("capacity", "no_space"):
            self.kv_evictions.labels(model_name, reason)
        self.preemptions.labels(model_name)
        self.prefill_beside.labels(model_name)
        for kind in ("prefill", "decode"):
            self.priority_yields.labels(model_name, kind)
        self.spec = SpecMetrics(registry, model_name)  # vllm:spec_decode_*, vllm:iteration_tokens_total
        self.kv_tier = KVTierMetrics(registry, model_name)  # vllm:external_prefix_cache_*, vllm:kv_offload_*
        self.grammar = StructuredMetrics(registry, model_name)  # constrained decoding (engines/grammar.py)
        self.structured = self.grammar.requests

    def observe_finished(self, last: GenerationOutput, e2e_s: float, external_tokens: int,
                         max_tokens: int | None = None) -> None:
        """One finished request (its final output): tokens, finish reason, where its prompt's KV came
        from (`external_tokens` of its cached tokens were fetched from the cache nodes), decode time,
        time per output token and its output limit (`max_tokens`, when it had one)."""
        m = self.model_name
        prompt_tokens, cached_tokens, completion_tokens = last.prompt_tokens, last.cached_tokens, last.completion_tokens
        decode_s = last.timings.decode_s if last.timings else None
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.request_prompt_tokens.labels(m).observe(prompt_tokens)
        self.request_generation_tokens.labels(m).observe(completion_tokens)
        if max_tokens is not None:
            self.request_max_tokens.labels(m).observe(max_tokens)
        self.prompt_tokens_cached.labels(m).inc(cached_tokens)
        self.prefill_computed.labels(m).observe(prompt_tokens - cached_tokens)
        if decode_s is not None:
            self.decode_time.labels(m).observe(decode_s)
        self.request_success.labels(m, finished_reason(last.finish_reason)).inc()
        external = max(0, min(external_tokens, cached_tokens))
        self.prompt_by_source.labels(m, "local_compute").inc(max(0, prompt_tokens - cached_tokens))
        self.prompt_by_source.labels(m, "local_cache_hit").inc(cached_tokens - external)
        self.prompt_by_source.labels(m, "external_kv_transfer").inc(external)
        self.cached_by_source.labels(m, "device").inc(cached_tokens - external)
        self.cached_by_source.labels(m, "external_unspecified").inc(external)
        if decode_s is not None and completion_tokens > 1:
            self.tpot.labels(m).observe(decode_s / (completion_tokens - 1))

    def observe_left_early(self) -> None:
        """A request whose client left before its first output (in the queue or its prefill): aborted with
        no tokens. Counted, as vLLM counts every aborted request; it was not (only a request with an output
        was), so a client that gave up on a long prefill left no trace in the abort count."""
        self.request_success.labels(self.model_name, "abort").inc()

    def observe_engine(self, engine: Engine, block_size: int, dtype: str) -> None:
        """At a scrape of a serving shard: the engine's gauges, and ``vllm:cache_config_info`` once."""
        stats = engine.stats()
        self.observe_stats(stats)
        if self._cache_described:
            return
        self._cache_described = True
        prefix = getattr(engine, "prefix", None)  # the torch engine's prefix cache (None: no KV kept)
        cache_dtype = str(getattr(prefix, "torch_dtype", dtype)).removeprefix("torch.")
        blocks = stats.prefix_cache_capacity_bytes // stats.prefix_cache_block_bytes if stats.prefix_cache_block_bytes else 0
        self.cache_config.labels(str(block_size), cache_dtype, str(prefix is not None), str(blocks), "0").set(1)

    def observe_stats(self, stats: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.running)
        self.waiting.labels(m).set(stats.waiting)
        self.waiting_by_reason.labels(m, "capacity").set(stats.waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.max_num_seqs.labels(m).set(stats.max_num_seqs)
        self.kv_blocks.labels(m).set(stats.prefix_cache_blocks)
        self.kv_bytes.labels(m).set(stats.prefix_cache_blocks * stats.prefix_cache_block_bytes)
        self.kv_capacity.labels(m).set(stats.prefix_cache_capacity_bytes)


class MetricsListener(StepListener):
    """Feeds engine-thread events into ShardMetrics (prometheus_client is thread-safe)."""

    def __init__(self, metrics: ShardMetrics) -> None:
        self.metrics = metrics

    def on_step(self, batch_size: int, step_s: float, kind: str) -> None:
        m = self.metrics
        m.batch_size.labels(m.model_name, kind).observe(batch_size)
        m.step_seconds.labels(m.model_name, kind).observe(step_s)

    def on_first_token(self, seq_ttft_s: float, prefill_s: float | None = None) -> None:
        # Prefill time is observed here, with TTFT, not at the request's end: the control plane's
        # "TTFT beyond prefill" subtracts one p95 from the other over a window, and on a slow CPU a
        # request's end can fall a window later than its first token (the other then reads None).
        m = self.metrics
        m.ttft.labels(m.model_name).observe(seq_ttft_s)
        if prefill_s is not None:
            m.prefill_time.labels(m.model_name).observe(prefill_s)

    def on_token(self, itl_s: float) -> None:
        self.metrics.itl.labels(self.metrics.model_name).observe(itl_s)
        self.metrics.itl_legacy.labels(self.metrics.model_name).observe(itl_s)

    def on_admit(self, queue_s: float) -> None:
        self.metrics.queue_time.labels(self.metrics.model_name).observe(queue_s)

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        m = self.metrics
        m.prefix_queries.labels(m.model_name).inc(queried_tokens)
        m.prefix_hits.labels(m.model_name).inc(hit_tokens)

    def on_kv_evict(self, reason: str, blocks: int) -> None:
        m = self.metrics
        m.kv_evictions.labels(m.model_name, reason).inc(blocks)

    def on_kv_block_evicted(self, lifetime_s: float, idle_s: float) -> None:
        m = self.metrics
        m.kv_block_lifetime.labels(m.model_name).observe(lifetime_s)
        m.kv_block_idle.labels(m.model_name).observe(idle_s)

    def on_kv_block_reused(self, gap_s: float) -> None:
        self.metrics.kv_block_reuse_gap.labels(self.metrics.model_name).observe(gap_s)

    def on_stage(self, stage: int, up: bool) -> None:
        m = self.metrics
        m.stage_up.labels(m.model_name, str(stage)).set(1 if up else 0)

    def on_pipeline_pass(self, timing: PassTiming) -> None:
        m = self.metrics
        m.pass_seconds.labels(m.model_name).observe(timing.wall_s)
        m.in_flight.labels(m.model_name).observe(timing.in_flight)
        if timing.active_s > 0:
            m.pipeline_active.labels(m.model_name).inc(timing.active_s)
        if timing.alone:
            m.alone_passes.labels(m.model_name).inc()
        for stage, (step, hop, sent) in enumerate(zip(timing.step_s, timing.hop_s, timing.hop_bytes)):
            label = str(stage)
            m.stage_step.labels(m.model_name, label).observe(step)
            m.hop_latency.labels(m.model_name, label).observe(hop)
            m.hop_bytes.labels(m.model_name, label).inc(sent)

    def on_pipeline_kv(self, op: KVHop, blocks: int, nbytes: int, seconds: float) -> None:
        m = self.metrics
        m.pipeline_kv_seconds.labels(m.model_name, op.value).observe(seconds)
        m.pipeline_kv_bytes.labels(m.model_name, op.value).inc(nbytes)

    def on_batch_sent(self, in_flight: int, decode: bool) -> None:
        m = self.metrics
        m.steps_in_flight.labels(m.model_name, "decode" if decode else "prefill").observe(in_flight)

    def on_tokens_restored(self, replies: int) -> None:
        self.metrics.tokens_restored.labels(self.metrics.model_name).inc(replies)

    def on_iteration_tokens(self, tokens: int) -> None:
        self.metrics.spec.observe_iteration(tokens)

    def on_spec_draft(self, drafted: int, accepted: int) -> None:
        self.metrics.spec.observe_draft(drafted, accepted)

    def on_spec_cost_probe(self, kind: str) -> None:
        self.metrics.spec.cost_probes.labels(self.metrics.model_name, kind).inc()

    def on_grammar_compile(self, kind: str, seconds: float, outcome: str) -> None:
        self.metrics.grammar.on_compile(kind, seconds, outcome)

    def on_grammar_resume(self, kind: str, outcome: str) -> None:
        self.metrics.grammar.on_resume(kind, outcome)

    def on_grammar_mask(self, rows: int, seconds: float) -> None:
        self.metrics.grammar.on_mask(seconds)

    def on_preempt(self, kind: str) -> None:
        m = self.metrics
        m.priority_yields.labels(m.model_name, kind).inc()
        if kind == "prefill":
            m.preemptions.labels(m.model_name).inc()

    def on_prefill_beside(self, prompts: int) -> None:
        self.metrics.prefill_beside.labels(self.metrics.model_name).inc(prompts)

    def on_weights(self, dtype: str, dtype_reason: str, quantization: str, quantization_reason: str,
                   weight_bytes: int, kernel: str = "torch") -> None:
        m = self.metrics
        m.weights_info.labels(m.model_name, dtype, dtype_reason, quantization, quantization_reason, kernel).set(1)
        m.weight_bytes.labels(m.model_name).set(weight_bytes)

    def on_threads(self, threads: int, reason: str) -> None:
        m = self.metrics
        m.intra_op_threads.labels(m.model_name).set(threads)
        if reason == "probe":
            m.thread_switches.labels(m.model_name).inc()
