"""Settings of the gateway process: every flag is also an environment variable
(``SWITCHBOARD_GATEWAY_<FIELD>``); parsed once in `data_plane.gateway.app.main`.

    settings = GatewaySettings(port=8000, registry_url="http://127.0.0.1:8300")
"""

from __future__ import annotations

from typing import Literal

from pydantic import AnyHttpUrl, Field, IPvAnyNetwork, PositiveFloat, PositiveInt, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from data_plane.common.settings_cli import CommaList, InputFile, InputFileOrYaml, TierMap
from data_plane.gateway.context import DEFAULT_TRIM_STEP_SHARE
from data_plane.membership.factory import MEMBERSHIP_URL_PATTERN
from data_plane.membership.placement import DEFAULT_ZONE, ZONE_PATTERN


class GatewaySettings(BaseSettings):
    """The chat gateway."""

    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_GATEWAY_")

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    registry_url: str | None = Field(None, description="Embedded registry URL (membership of shards/caches).")
    membership: str | None = Field(None, pattern=MEMBERSHIP_URL_PATTERN,
                                   description="Membership URL, e.g. consul://127.0.0.1:8500 (wins over --registry-url).")
    control_plane_url: str | None = Field(None, description="Control plane URL for the degradation level and the hot tier policy (default: --registry-url).")
    shard_urls: CommaList[AnyHttpUrl] = Field(default_factory=list, description="Comma-separated shard URLs (static, instead of a registry).")
    cache_urls: CommaList[AnyHttpUrl] = Field(default_factory=list, description="Comma-separated cache-node URLs (static).")
    keys_file: InputFile | None = Field(None, description="YAML file of API keys -> tenant, tier.")
    api_keys: str | None = Field(None, description="Extra keys, 'key:tenant:tier,...' (env SWITCHBOARD_GATEWAY_API_KEYS).")
    tiers_file: InputFileOrYaml | None = Field(None, description="YAML tier policy (default: built-in free/plus/enterprise).")
    safety_file: InputFileOrYaml | None = Field(None, description="YAML safety policies (default: built-in).")
    tokenizer: str | None = Field(None, description="Model folder/GGUF whose tokenizer counts tokens; 'whitespace' for synthetic shards.")
    model_name: str = Field("SmolLM2-135M-Instruct", description="Model id served when shards do not say.")
    max_model_len: int = Field(2048, ge=16, description="Context window when shards do not say.")
    context_trim_step: float = Field(DEFAULT_TRIM_STEP_SHARE, ge=0, le=1, description=(
        "Share of the context window the sliding window drops at a time, at cuts fixed by the conversation, "
        "so the prompt's start (the shard's prefix cache) stays put for that many tokens of new turns "
        "(0: drop just enough, the start changing every turn)."))
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body (413 beyond).")
    max_messages: int = Field(256, ge=1, description="Most messages one request may carry.")
    session_ttl_s: float = Field(86400.0, gt=0, description="Session transcript lifetime since last use.")
    response_cache: bool = Field(False, description="Answer identical deterministic requests of a tenant from the cache nodes (opt-in, as LiteLLM's and Kong's caches).")
    response_cache_ttl_s: float = Field(600.0, gt=0, le=30 * 86400, description="Lifetime of a cached reply.")
    response_cache_local_bytes: int = Field(16 << 20, ge=0, le=1 << 36, description="Bytes of cached replies each gateway also keeps in memory, so a hit needs no cache-node round trip (0: none).")
    connect_timeout_s: float = Field(2.0, gt=0, description="Connect timeout to a shard.")
    first_token_timeout_s: float = Field(60.0, gt=0, description="Send-to-first-token timeout per attempt.")
    idle_timeout_s: float = Field(30.0, gt=0, description="Longest pause between streamed tokens.")
    silence_timeout_s: float = Field(2.0, gt=0, le=600, description=(
        "A shard that announces SSE keep-alives and sends nothing for this long has failed: retry or resume elsewhere."))
    retries: int = Field(1, ge=0, le=3, description="Retries on another shard before the first token.")
    resumes: int = Field(2, ge=0, le=5, description="Mid-stream failovers per request (resume on another shard).")
    resume_wait_s: float = Field(0.0, ge=0, le=600, description=(
        "How long a stream that broke mid-way waits for a shard to continue on when no other is left (a lone shard "
        "or pipeline group restarting; `switchboard up` sets 30). 0: it ends with an error at once."))
    eject_after: int = Field(3, ge=1, description="Consecutive failures that eject a shard.")
    eject_s: float = Field(5.0, gt=0, description="First ejection's duration (doubles on repeat).")
    outlier_failure_percent: float = Field(40.0, ge=0, le=100, description="Eject a shard when this percentage of its calls in the outlier window failed by its (or its link's) fault, even with successes in between (0: off).")
    outlier_request_volume: int = Field(20, ge=1, description="Calls a shard needs in the outlier window before its failure percentage is judged.")
    outlier_window_s: float = Field(30.0, gt=0, le=3600, description="The sliding window of the failure-percentage outlier detection.")
    outlier_max_ejection_percent: float = Field(50.0, gt=0, le=100, description="Most shards (percent, at least one) the failure percentage ejects at once; never the last in routing.")
    latency_aware: bool = Field(True, description="Weigh shards by a peak-EWMA of their time to first token: sessionless requests compare latency x (outstanding + 1) of two shards, and, with --latency-spill-factor set, sessions leave a shard that is a clear latency outlier (--no-latency-aware: outstanding requests alone, as before).")
    latency_decay_s: float = Field(10.0, gt=0, le=600, description="Time constant of the latency estimate: how fast it forgets a slow first token.")
    latency_spill_factor: float = Field(0.0, ge=0, le=1000, description="Sessions leave a shard whose latency estimate is above this many times the other shards' median (0, the default: never; else above 1, 3 is a start). Opt-in: time to first token includes prefill, so a shard holding long-prompt sessions looks slow too.")
    latency_spill_floor_s: float = Field(1.0, ge=0, le=600, description="... and above this many seconds.")
    latency_spill_min_samples: int = Field(2, ge=1, le=100, description="... and that answered that slowly this many times within --latency-slow-window-s (one long prefill moves no sessions).")
    latency_slow_window_s: float = Field(30.0, gt=0, le=3600, description="Window of those slow answers.")
    routing_policy: Literal["affinity", "least_loaded", "kv_aware"] = Field("kv_aware", description="kv_aware (the default: the shard holding the session's KV against the ring's choice, by expected cached tokens and load; session affinity is the case where they agree) | affinity (the ring alone) | least_loaded.")
    bounded_load_epsilon: float = Field(0.25, ge=0, description="Affinity: no shard above (1+eps) x mean load.")
    log_prompts: bool = Field(False, description="Log prompt and completion text (off by default).")
    node_id: str | None = Field(None, description="Member id when registering (default gateway-HOST-PORT).")
    zone: str = Field(DEFAULT_ZONE, pattern=ZONE_PATTERN, description=(
        "Zone (failure domain) this gateway runs in: it prefers shards and session replicas of its own zone."))
    zone_spill_slack: float = Field(0.25, ge=0, le=100, description=(
        "Route to other zones only when the local zone's mean load exceeds (1 + this) x theirs + 1 request."))
    ratelimit_backend: Literal["local", "redis"] = Field("local", description="Rate-limit state: local (one gateway) | redis (shared by all; fails open to local).")
    redis_url: str | None = Field(None, description="Redis URL for --ratelimit-backend redis, e.g. redis://127.0.0.1:6379/0.")
    tier_rpm: TierMap[PositiveInt] = Field(default_factory=dict, description="Aggregate RPM per tier over all its keys, e.g. 'free=600' (keys also keep their tier's own rpm).")
    tier_tpm: TierMap[PositiveInt] = Field(default_factory=dict, description="Aggregate TPM per tier over all its keys, e.g. 'free=200000'.")
    max_inflight: int = Field(0, ge=0, description="Requests in flight to shards from this gateway (0 = shards' batch slots x --inflight-per-slot).")
    inflight_per_slot: float = Field(1.0, gt=0, le=16, description="In-flight requests per announced shard batch slot when --max-inflight is 0.")
    admission_reserve: float = Field(0.125, ge=0, lt=1, description="Share of in-flight capacity each priority level leaves to the levels above it.")
    admission_tenant_headroom: int = Field(1, ge=0, le=1024, description="Slots of a tier's share that a tenant with a request in flight leaves to the tier's other tenants while more than one is active (0 = off).")
    admission_tenant_window_s: float = Field(30.0, gt=0, le=86400, description="Seconds a tenant counts as active in its tier after its last admitted request (for the tenant headroom).")
    queue_size: int = Field(512, ge=0, description="Most requests waiting for admission; beyond, the lowest tier's newest is shed (503).")
    queue_timeout_s: float = Field(5.0, gt=0, description="Admission-queue deadline of the tier shed first; the k-th shed level waits k times as long.")
    queue_timeouts: TierMap[PositiveFloat] = Field(default_factory=dict, description="Per-tier admission-queue deadlines in seconds, e.g. 'free=2,enterprise=30'.")
    state_dir: str = Field(".switchboard", description="Folder for the gateway's local state (the usage ledger's spool and default SQLite file).")
    usage_db: str | None = Field(None, description="Usage ledger database: sqlite:///path (default STATE_DIR/usage.db), postgresql://..., or 'off'.")
    usage_spool_dir: str | None = Field(None, description="Usage spool folder, one per gateway (default STATE_DIR/ledger-spool/<node>-<pid>-<rand>; orphans are adopted).")
    usage_flush_interval_s: float = Field(1.0, gt=0, le=60, description="Seconds between batch writes of spooled usage records to the database.")
    session_keys_file: InputFile | None = Field(None, description="Keys that encrypt session transcripts at rest: one '<key id> <base64 32 bytes>' per line, the first seals (default: derived from the cluster token).")
    session_keys: str | None = Field(None, description="The same as 'kid:base64,kid:base64' (env SWITCHBOARD_GATEWAY_SESSION_KEYS); the first seals.")
    trusted_proxies: CommaList[IPvAnyNetwork] = Field(default_factory=list, description="Networks of the load balancers in front (CIDRs, comma-separated): only from these is X-Forwarded-For believed (its rightmost hop that is not one of them is the client, e.g. for address bans); from any other peer it is ignored.")
    background_per_tenant: int = Field(8, ge=0, le=10_000, description="Background responses (background: true) a tenant may have queued or in progress on this gateway at once; beyond, 429 with Retry-After (0: background mode off, a 400).")
    background_max_s: float = Field(1800.0, gt=0, le=86400, description="Longest a background response may run: past it, it is stopped and stored failed; a reader that finds one stored unfinished past this (its gateway died) reports it failed.")
    background_keep_s: float = Field(600.0, ge=0, le=86400, description="Seconds a finished background response's events stay in memory for streams that resume (GET ?stream=true&starting_after=N).")
    background_event_bytes: int = Field(4 << 20, ge=4096, le=1 << 30, description="Bytes of streamed events held per background response; beyond, the oldest are dropped (a resume before them is a 400).")
    background_held: int = Field(256, ge=1, le=100_000, description="Background responses whose events this gateway holds at once (finished ones are dropped first, oldest first).")
    usage_retention_days: float = Field(90.0, ge=0, description="Usage records older than this are deleted (0 = keep forever).")

    @field_validator("usage_db")
    @classmethod
    def _usage_db(cls, v: str | None) -> str | None:
        from data_plane.ledger.store import check_usage_db

        return check_usage_db(v)

    @field_validator("latency_spill_factor")
    @classmethod
    def _spill_factor_above_one(cls, factor: float) -> float:
        """At or below 1 a shard faster than the others' median was an 'outlier' too: with two shards both
        were, and every session's turn moved it to the other one (losing its KV locality each time)."""
        if 0 < factor <= 1:
            raise ValueError(f"0 (sessions never leave for latency) or above 1, e.g. 3, not {factor:g}: at or "
                             "below 1 a shard no slower than the others' median counts as an outlier")
        return factor
