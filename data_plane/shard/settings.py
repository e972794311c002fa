"""Settings of the shard process: every flag is also an environment variable (``SWITCHBOARD_SHARD_<FIELD>``).

    settings = ShardSettings(port=8101, engine="synthetic")
    settings = parse_settings(ShardSettings, argv, prog="switchboard shard")   # data_plane/shard/app.py main()

Parsed once in the shard's ``main`` (data_plane/shard/app.py) and passed down: to ``create_app``,
the engine factory (data_plane/shard/engine_factory.py) and, with ``--engine vllm``, the sidecar
(data_plane/shard/engines/vllm_engine.py, which declares the fields it reads as a protocol). The local actuator starts shards with these flags.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from data_plane.common.settings_cli import InputFile
from data_plane.membership.factory import MEMBERSHIP_URL_PATTERN
from data_plane.membership.placement import DEFAULT_ZONE, ZONE_PATTERN


class ShardSettings(BaseSettings):
    """An inference shard."""

    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_SHARD_")
    ENV_ONLY: ClassVar[frozenset[str]] = frozenset({"kv_keys"})
    """Secrets: an environment variable only, never a flag (it would show in ``ps``)."""

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8101, ge=0, le=65535, description="TCP port to listen on.")
    engine: Literal["torch", "synthetic", "vllm"] = Field("torch", description="Engine: torch | synthetic | vllm.")
    model: str | None = Field(None, description="Local HF model folder or GGUF file (default SmolLM2-135M-Instruct).")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="Activations dtype: auto (float32 for --quantization-kernel blockq_x2 or blockq_exact; "
        "else bfloat16 where the CPU has native bf16 or the weights are quantized, else float32; said in the ready "
        "line), bfloat16, float16 or float32 (batch-invariant)."
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="Weight format: auto (a GGUF's Q4 blocks as int4, Q8_0 as int8, a dense model as is), "
        "none, int8 (per channel) or int4 (groups of 32).")
    quantization_kernel: Literal["auto", "blockq", "blockq_x2", "blockq_exact", "torch"] = Field(
        "auto", description="What computes quantized projections: auto (blockq, int8 activations x the weight "
        "blocks, where its C kernel builds; blockq_exact, float32 activations x the same blocks, for an explicit "
        "float32 quantized format), blockq, blockq_x2 (two int8 planes of activations "
        "and the GGUF's Q8_0 table; float32 activations around them with --dtype auto, bfloat16 only if asked "
        "for: float32 dense's greedy tokens on `switchboard bench quality`'s prompts, at 0.64-0.84x blockq's "
        "tok/s), blockq_exact or torch.")
    max_num_seqs: int = Field(16, ge=1, le=256, description="Sequences decoded together (KV slots).")
    max_model_len: int = Field(2048, ge=16, le=131072, description="Context window (prompt + output).")
    prefill_chunk: int = Field(256, ge=1, le=8192, description="Prompt tokens prefilled per scheduler step.")
    beside_prefill_share: float = Field(0.5, ge=0, le=0.9, description=(
        "Share of a chunked prefill's step that waiting prompts of its priority may take, prefilled in its pass "
        "(0 = FIFO within a priority)."))
    max_waiting: int = Field(256, ge=1, le=100000, description="Waiting-queue bound (beyond: 503).")
    threads: int = Field(0, ge=0, le=256, description="torch threads (0 = all cores when adaptive, else all but one).")
    adaptive_threads: Literal["on", "off"] = Field(
        "on", description="Measure decode steps at 1 and at --threads threads, keep the faster (bf16/fp16): on | off.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body.")
    registry_url: str | None = Field(None, description="Embedded registry URL to register with.")
    membership: str | None = Field(None, pattern=MEMBERSHIP_URL_PATTERN,
                                   description="Membership URL, e.g. consul://127.0.0.1:8500 (wins over --registry-url).")
    node_id: str | None = Field(None, description="Member id (default shard-HOST-PORT).")
    zone: str = Field(DEFAULT_ZONE, pattern=ZONE_PATTERN, description="Zone (failure domain) this shard runs in.")
    keepalive_s: float = Field(0.5, ge=0, le=60, description=(
        "Send an SSE keep-alive comment after this long without output, so gateways tell a slow shard from a "
        "dead one in ~2 s (0 = never; announced in membership)."))
    registration_ttl_s: float = Field(0.8, gt=0.1, le=300, description="Membership TTL; a dead shard leaves routing within it.")
    advertise_url: str | None = Field(None, description="URL others use to reach this shard.")
    synthetic_token_delay_ms: float = Field(0.0, ge=0, le=10000, description="Synthetic engine: delay per token.")
    log_prompts: bool = Field(False, description="Log prompt and completion text (off by default).")
    prefix_caching: Literal["on", "off"] = Field("on", description="Reuse cached KV of prompt prefixes: on | off.")
    prefix_cache_bytes: int = Field(0, ge=0, le=1 << 40,
                                    description="Prefix-cache byte budget (0 = auto: 1/16 of RAM, at most 1 GiB).")
    kv_block_size: int = Field(16, ge=1, le=1024, description="Tokens per prefix-cache block (reuse granularity).")
    speculation: Literal["ngram", "off"] = Field("ngram", description=(
        "Speculative decoding: ngram (prompt-lookup drafts, verified in the decode pass) | off."))
    num_speculative_tokens: int = Field(15, ge=1, le=16, description="Most draft tokens per sequence and step.")
    spec_max_batch: int = Field(4, ge=1, le=256, description="No drafting while more sequences than this run.")
    jump_forward: bool = Field(True, description=(
        "Constrained decoding: draft the tokens a grammar forces and verify them in one pass, speculation on or "
        "off (docs/STRUCTURED.md)."))
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Stage processes this shard's layers are split over (torch: data_plane/shard/engines/pipeline.py; "
        "vllm: passed through)."))
    pipeline_layers: str | None = Field(None, pattern=r"^\d+(,\d+)*$", description=(
        "Where stages 1.. start, e.g. '10,20' (default: an even split)."))
    pipeline_stage_timeout_s: float = Field(1.0, ge=0.2, le=60, description=(
        "A pipeline stage silent this long is lost: the shard fails its streams (resumed elsewhere) and exits."))
    pipeline_microbatches: int = Field(0, ge=0, le=64, description=(
        "Micro-batches a forward pass that goes alone (prompt rows; every pass with --pipeline-batch-queue 1) "
        "is split into, in flight at once through the stages (0: as many as stages; 1: whole)."))
    pipeline_batch_queue: int = Field(0, ge=0, le=64, description=(
        "Steps in flight at once through the stages (vLLM's batch queue): decoding sequences go in that many "
        "contiguous groups, the next sent while the previous is in later stages (0: as many as stages; "
        "1: each step waits for its pass)."))
    pipeline_host: str = Field("127.0.0.1", description=(
        "Stage 0's address for the pipeline group (its TCPStore and pipeline links): a stage on another host must reach it."))
    pipeline_port: int = Field(0, ge=0, le=65535, description=(
        "The pipeline group's TCPStore port (0: a free one; set it when stages join from other hosts)."))
    pipeline_remote_stages: str | None = Field(None, pattern=r"^\d+(,\d+)*$", description=(
        "Stages that join from other hosts (`switchboard stage --join HOST:PORT --rank R` there) instead of "
        "being started here, e.g. '1'."))
    pipeline_exit_linger_s: float = Field(2.0, ge=0, le=60, description=(
        "After losing a stage (streams failed, out of membership) the shard keeps answering /metrics this long "
        "before exiting, so a scrape sees the stage down (set it to your scrape interval)."))
    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "vllm engine only: passed through as --tensor-parallel-size (the torch engine has no tensor "
        "parallelism: docs/SHARDING.md)."))
    kv_public_prefix: list[str] = Field(default_factory=list, description=(
        "System prompts the operator marks public: their KV is shared across tenants (JSON list)."))
    kv_tier: Literal["on", "off"] = Field("on", description=(
        "Keep sessions' KV blocks on the cache nodes and fetch missing prefixes from them when cheaper: on | off."))
    kv_fetch_prior_mbps: float = Field(200.0, gt=0, le=1e6, description=(
        "Assumed cache-node transfer rate in MB/s until one is measured (then learned online)."))
    kv_prefill_prior_tok_s: float = Field(500.0, gt=0, le=1e7, description=(
        "Assumed prefill speed in tokens/s until one is measured (then learned online)."))
    kv_offload_queue_bytes: int = Field(256 << 20, ge=0, le=1 << 36, description=(
        "KV of finished turns waiting to go to the cache nodes; beyond it new turns' blocks are dropped."))
    kv_seal: Literal["on", "off"] = Field("on", description=(
        "Seal KV blocks (AES-256-GCM) before they reach a cache node and open them after a fetch: on | off "
        "(off stores plaintext KV: only to measure the cost)."))
    kv_keys_file: InputFile | None = Field(None, description=(
        "Keys that seal KV blocks: one '<key id> <base64 32 bytes>' per line, the first seals, every one opens; "
        "may be the gateway's --session-keys-file (KV keys are derived from it with their own label). "
        "Default: SWITCHBOARD_SHARD_KV_KEYS, else derived from the cluster token."))
    kv_keys: str | None = Field(None, description=(
        "The KV keys as 'kid:base64,kid:base64' (environment only: SWITCHBOARD_SHARD_KV_KEYS); the first seals."))

    @field_validator("kv_public_prefix", mode="before")
    @classmethod
    def _json_list(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    def pipeline_placement(self) -> dict[str, Any]:
        """Where the pipeline group lives, as EngineConfig fields (a stage on another host joins it)."""
        remote = tuple(int(r) for r in (self.pipeline_remote_stages or "").split(",") if r)
        return {"pipeline_host": self.pipeline_host, "pipeline_port": self.pipeline_port,
                "pipeline_remote_stages": remote}


__all__ = ["ShardSettings"]
