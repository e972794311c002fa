"""`switchboard up`'s flags: counts, ports, engine, state dir, TLS, zones (control_plane/launcher.py runs them).

    s = parse_settings(UpSettings, argv, prog="switchboard up")   # data_plane/common/settings_cli.py
    s.shards, s.gateway_port, s.zones                                 # every field a flag and SWITCHBOARD_UP_*

Its own module so that the launcher and what it prints (control_plane/up_banner.py) share one type.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from data_plane.common.settings_cli import REDIS_URL_PATTERN, InputFile
from data_plane.membership.placement import ZONE_PATTERN


class UpSettings(BaseSettings):
    """Start the whole Switchboard platform on this machine."""

    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_UP_")

    host: str = Field("127.0.0.1", description="Address the processes bind; not the console's without --tls, "
                      "nor Prometheus' ever: those stay on 127.0.0.1 (the login carries the admin token).")
    gateway_port: int = Field(8000, ge=1, le=65535, description="Chat API port.")
    control_plane_port: int = Field(8300, ge=1, le=65535, description="Control plane / registry port.")
    console_port: int = Field(8501, ge=1, le=65535, description="Admin console port (on 127.0.0.1 unless --tls; see --host).")
    shards: int = Field(2, ge=0, le=64, description="Inference shards to start.")
    cache_nodes: int = Field(2, ge=1, le=64, description="Cache nodes to start.")
    shard_base_port: int = Field(0, ge=0, le=65535, description="First shard port (0 = free ports).")
    cache_base_port: int = Field(0, ge=0, le=65535, description="First cache-node port (0 = free ports).")
    engine: Literal["torch", "synthetic", "vllm"] = Field("torch", description="Shard engine.")
    model: str | None = Field(None, description="Local HF folder or GGUF (default SmolLM2-135M-Instruct).")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="Shard activations dtype (auto: the fastest on this CPU).")
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="Shard weight format (auto: a GGUF's Q4 blocks as int4).")
    quantization_kernel: Literal["auto", "blockq", "blockq_x2", "blockq_exact", "torch"] = Field(
        "auto", description="What computes the shards' quantized projections (the shard's --quantization-kernel; "
                            "blockq_x2 keeps float32's greedy tokens).")
    max_num_seqs: int = Field(16, ge=1, le=256, description="Batch slots per shard.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Stage processes per shard (a replica is a whole pipeline group: data_plane/shard/engines/pipeline.py)."))
    max_model_len: int = Field(2048, ge=16, description="Context window per shard.")
    state_dir: str = Field(".switchboard", description="Where credentials, logs, the usage ledger and the cache nodes' records (without --redis) go.")
    redis: str | None = Field(None, pattern=REDIS_URL_PATTERN,
                              description="Redis URL for cache nodes (default: in memory).")
    log_max_bytes: int = Field(50 * 2**20, ge=0, description=(
        "Rotate a process's log in STATE_DIR/logs when it reaches this size (copy, then truncate; 0 = never)."))
    log_backups: int = Field(3, ge=0, le=100, description="Rotated copies kept per log (<name>.log.1 is the newest).")
    prometheus: bool = Field(False, description="Also start Prometheus (when the binary exists) with the alert "
                             "rules, on 127.0.0.1 (no auth), scraping with STATE_DIR/metrics_token.")
    prometheus_port: int = Field(9090, ge=1, le=65535, description="Prometheus port (with --prometheus).")
    console: bool = Field(True, description="Start the admin console (Streamlit) on --console-port.")
    autoscale: bool = Field(False, description="Let the control plane's autoscaler start and stop the shards.")
    min_replicas: int = Field(1, ge=1, le=64, description="With --autoscale: fewest shards.")
    max_replicas: int = Field(4, ge=1, le=64, description="With --autoscale: most shards.")
    usage_db: str | None = Field(None, description="Usage ledger database for gateways and control plane (default: sqlite in --state-dir; postgresql://... to share).")
    abuse_rules: InputFile | None = Field(None, description="YAML of abuse-monitor thresholds for the control plane "
                                    "(control_plane/abuse/model.py; default: built-in).")
    trusted_proxies: str | None = Field(None, description="CIDRs of load balancers in front of the gateways: "
                                        "only from them is X-Forwarded-For believed (the gateway's --trusted-proxies).")
    response_cache: bool = Field(False, description="Gateways answer identical deterministic requests of a tenant "
                                 "from the cache nodes (opt-in).")
    tls: bool = Field(False, description="Run every listener and hop on TLS with a local CA and certificate made in STATE_DIR/tls.")
    zones: list[str] = Field(default_factory=list, description=(
        "Zones to spread the processes over, e.g. a,b: shards and cache nodes round-robin (at least one of each "
        "per zone), one gateway per zone on --gateway-port, +1, ... (default: one zone, 'local')."))

    @field_validator("usage_db")
    @classmethod
    def _usage_db(cls, v: str | None) -> str | None:
        from data_plane.ledger.store import check_usage_db

        return check_usage_db(v)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: str | None) -> str | None:
        if v:
            import ipaddress

            for net in v.split(","):
                ipaddress.ip_network(net.strip(), strict=False)  # ValueError: "... does not appear to be ..."
        return v

    @field_validator("zones", mode="before")
    @classmethod
    def _zone_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = json.loads(v) if v.startswith("[") else [z.strip() for z in v.split(",") if z.strip()]
        return v

    @field_validator("zones")
    @classmethod
    def _zone_names(cls, v: list[str]) -> list[str]:
        bad = [z for z in v if not re.match(ZONE_PATTERN, z)]
        if bad:
            raise ValueError(f"zone names must match {ZONE_PATTERN}: {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"zones listed twice: {v}")
        return v

