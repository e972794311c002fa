"""Settings of the control-plane process, parsed once in `main()` and passed down.

    settings = ControlPlaneSettings(port=8300, admin_token="s3cret")
    app = create_app(settings)

Every field can be set by flag (``--<field-name>``, data_plane/common/settings_cli.py) or by environment
variable: ``SWITCHBOARD_CONTROL_PLANE_<FIELD>`` (e.g. ``SWITCHBOARD_CONTROL_PLANE_PORT=8300``),
except the admin token, which every process that talks to the admin API shares as
:data:`ENV_ADMIN_TOKEN`. Flags win over the environment, the environment over defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from control_plane.registry.consul import CONSUL_URL_PATTERN
from control_plane.slo import TTFT_SLO_S
from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV, METRICS_TOKEN_ENV
from data_plane.common.settings_cli import InputPath

ENV_PREFIX = "SWITCHBOARD_CONTROL_PLANE_"
"""Prefix of the environment variables that configure the control plane."""
ENV_ADMIN_TOKEN = "SWITCHBOARD_ADMIN_TOKEN"
"""Bearer token that protects ``/admin/v1/...`` (shared with the admin console)."""
ENV_CLUSTER_TOKEN = CLUSTER_TOKEN_ENV
"""Shared by the control plane and its members: registering and deregistering need it."""

DEFAULT_SERVICES = ("shard", "cache", "gateway")


class ControlPlaneSettings(BaseSettings):
    """Run the control plane: membership registry, admin API, degradation ladder, autoscaler."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True, frozen=True, use_attribute_docstrings=True
    )
    FLAG_ALIASES: ClassVar[dict[str, str]] = {
        "--reap-interval": "reap_interval_s", "--deregister-critical-after": "deregister_critical_after_s",
        "--max-wait": "max_wait_s", "--warmup": "warmup_s", "--default-ttl": "default_ttl_s",
        "--shutdown-grace": "shutdown_grace_s", "--degradation-interval": "degradation_interval_s",
        "--degradation-raise-dwell": "degradation_raise_dwell_s",
        "--degradation-lower-dwell": "degradation_lower_dwell_s",
        "--degradation-lower-dwell-gauge": "degradation_lower_dwell_gauge_s",
        "--degradation-raise-queue-time": "degradation_raise_queue_time_s", "--signals-window": "signals_window_s",
    }
    """Deprecated flag spellings (before every flag was its field's name), kept working."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = Field(default=8300, ge=1, le=65535)
    """TCP port of the registry and admin API."""
    admin_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("admin_token", ENV_ADMIN_TOKEN)
    )
    """Bearer token for ``/admin/v1/...``; without one the admin API answers 401 to everyone."""
    cluster_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("cluster_token", ENV_CLUSTER_TOKEN)
    )
    """Bearer token members present to register or deregister in the embedded registry (a member
    is sent user prompts, so joining is not for everyone). Unset: anyone who can reach the port
    may register, which is logged as a warning at start (`switchboard up` always sets one)."""
    metrics_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("metrics_token", METRICS_TOKEN_ENV)
    )
    """Read-only token for ``/metrics`` (the cluster token opens it too): what Prometheus is given. The
    embedded signal reader presents the cluster token (every member accepts it), this one only without it."""
    services: Annotated[tuple[str, ...], NoDecode] = DEFAULT_SERVICES
    """Service names members may register under, comma-separated in env/flags (they become metric
    labels, so the set is closed)."""
    reap_interval_s: float = Field(default=0.2, gt=0.0, le=5.0)
    """How often TTLs are checked; a silent member leaves routing within ttl + this."""
    deregister_critical_after_s: float = Field(default=60.0, ge=0.0, le=86400.0)
    """A member critical this long is removed from the registry."""
    max_wait_s: float = Field(default=60.0, ge=0.0, le=600.0)
    """Upper bound on a blocking query's ``wait``."""
    warmup_s: float = Field(default=3.0, ge=0.0, le=600.0)
    """After a (re)start the registry tells clients its list may still be filling up for this long."""
    default_ttl_s: float = Field(default=10.0, ge=0.1, le=3600.0)
    """TTL of a member that registers without one."""
    membership: str | None = Field(default=None, pattern=CONSUL_URL_PATTERN)
    """``consul://host:8500``: members live in Consul and the admin API reads them there; this process
    then hosts no registry. Unset: the embedded registry, hosted here."""
    shutdown_grace_s: int = Field(default=5, ge=0, le=300)
    """Seconds in-flight requests get to finish on SIGTERM/SIGINT."""
    access_log: bool = False
    """Log every HTTP request (heartbeats make this noisy)."""
    state_dir: Path | None = None
    """Directory where the tier policy, the degradation level and the operator's drains are persisted
    (JSON, written atomically), and the abuse monitor's actions (sealed), restored from at start;
    without one they live in memory only."""
    processes_file: Path | None = None
    """The process table `switchboard up`'s supervisor writes (STATE_DIR/processes.json: pids, starts,
    restarts, exits), served at /admin/v1/processes and as switchboard_up_process_* metrics; unset: none."""
    state_keys_file: InputPath | None = None
    """Keys that seal the abuse monitor's state in the state dir (the session keys file's format: the
    first seals, every listed one opens); default: a key derived from the cluster token."""
    tiers_file: InputPath | None = None
    """YAML tier policy put in force at start when the state dir holds none (default: built-in)."""
    usage_db: str | None = None
    """Usage ledger database the gateways write (``sqlite:///path``, ``postgresql://…``, or ``off``);
    ``/admin/v1/usage`` reads it. Default: ``sqlite:///.switchboard/usage.db``, the gateway's default."""
    abuse_rules: InputPath | None = None
    """YAML of abuse-monitor thresholds (control_plane/abuse/model.py AbuseConfig); default: built-in."""
    alertmanager: str | None = None
    """Alertmanager base URL; ``/admin/v1/alerts`` then lists its active alerts."""
    degradation_interval_s: float = Field(default=2.0, gt=0.0, le=60.0)
    """How often the degradation ladder reads the signals."""
    degradation_raise_dwell_s: float = Field(default=10.0, ge=0.0, le=3600.0)
    """Least time at a degradation level before the automatic rule raises it."""
    degradation_lower_dwell_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    """Least time at a level, and of unbroken calm signals, before the automatic rule lowers a level
    raised by a windowed figure (queue time p95, TTFT beyond prefill, error rate)."""
    degradation_lower_dwell_gauge_s: float = Field(default=10.0, ge=0.0, le=3600.0)
    """The same for a level raised by a gauge (waiting per shard, KV usage) or pinned by an operator."""
    degradation_raise_queue_time_s: float = Field(default=TTFT_SLO_S, gt=0.5, le=600.0)
    """Queue time p95 (admission wait + shard queue) above which the ladder rises (with a queue); by
    default the TTFT SLO's default."""

    # -- signals and autoscaling (control_plane/signals/, scaling/ policy + loop, actuators/) ----------
    prometheus: str | None = Field(default=None, pattern=r"^https?://")
    """Prometheus base URL: read the signals with PromQL instead of scraping members' /metrics."""
    signals_window_s: float = Field(default=30.0, ge=1.0, le=3600.0)
    """Window of the rates and percentiles in the signals (TTFT p95, error rate, demand)."""
    autoscale: bool = False
    """Run the autoscaler (off by default)."""
    actuator: Literal["local", "nomad", "kubernetes"] = "local"
    """How replicas change: local shard processes, Nomad's job scale API, or a Deployment's scale."""
    min_replicas: int = Field(default=1, ge=0, le=1000)
    """Fewest shards the autoscaler keeps."""
    max_replicas: int = Field(default=4, ge=1, le=1000)
    """Most shards the autoscaler runs."""
    target_waiting_per_shard: float = Field(default=2.0, gt=0.0, le=10000.0)
    """Requests waiting for a batch slot per shard that the fleet is sized for."""
    ttft_slo_s: float = Field(default=TTFT_SLO_S, gt=0.0, le=3600.0)
    """Time-to-first-token p95 objective, seconds (also the degradation ladder's); scaling and the
    ladder hold it against TTFT *beyond prefill*, never raw TTFT (which grows with the prompt)."""
    target_queue_time_s: float = Field(default=1.0, gt=0.0, le=600.0)
    """Queue time p95 (admission wait + shard queue) the fleet is sized for; above it (with a
    queue or busy batches) the autoscaler scales out."""
    scale_up_cooldown_s: float = Field(default=15.0, ge=0.0, le=86400.0)
    """Least seconds after a scaling before scaling up again (fast up)."""
    scale_down_cooldown_s: float = Field(default=120.0, ge=0.0, le=86400.0)
    """Least seconds after a scaling before scaling down, and how long load must stay low (slow down)."""
    autoscale_interval_s: float = Field(default=5.0, gt=0.0, le=600.0)
    """Seconds between autoscaler decisions."""
    shard_args: str = ""
    """Local actuator: extra flags for every shard it starts, shell-quoted (e.g. "--engine synthetic")."""
    shard_log_dir: Path = Path(".switchboard/logs")
    """Local actuator: where the shards it starts write their logs."""
    drain_timeout_s: float = Field(default=30.0, ge=0.0, le=3600.0)
    """Local actuator: longest wait for a drained shard to finish its requests before SIGTERM."""
    shard_zones: str = ""
    """Local actuator: the zones (comma-separated) new shards go into from the start, before any member
    of them registers; `switchboard up --zones a,b --autoscale` sets it. Without it the first shards,
    started before the zones' cache nodes and gateways are seen, join the default zone."""
    local_max_shards: int = Field(default=0, ge=0, le=4096)
    """Local actuator: most shard processes this host runs (0 = no cap); set it to cores / --threads, as
    a shard beyond the cores slows every shard instead of adding capacity. A scale-out past it is
    recorded with the outcome "capped"."""
    nomad_addr: str = Field(
        default="http://127.0.0.1:4646", validation_alias=AliasChoices("nomad_addr", "NOMAD_ADDR")
    )
    """Nomad actuator: the Nomad HTTP API (also read from NOMAD_ADDR, as the nomad CLI does)."""
    nomad_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("nomad_token", "NOMAD_TOKEN")
    )
    """Nomad actuator: ACL token with read-job-scaling and scale-job (also read from NOMAD_TOKEN)."""
    nomad_job: str = "switchboard"
    """Nomad actuator: the job that runs the shards."""
    nomad_group: str = "shard"
    """Nomad actuator: the shards' task group in that job."""
    nomad_namespace: str | None = None
    """Nomad actuator: the job's namespace (Nomad's default when unset)."""
    nomad_region: str | None = None
    """Nomad actuator: the job's region (the agent's when unset)."""
    kubeconfig: InputPath | None = None
    """Kubernetes actuator: kubeconfig path; unset: in-cluster service account, else $KUBECONFIG."""
    kube_namespace: str | None = None
    """Kubernetes actuator: the Deployment's namespace (default: the context's or the pod's)."""
    kube_deployment: str = "switchboard-shard"
    """Kubernetes actuator: the shards' Deployment."""
    pipeline_group_template: InputPath | None = None
    """Kubernetes and Nomad actuators: a replica is a whole pipeline group placed across nodes, made
    from this spec instead of a replica of the shard Deployment / task group: a YAML of the group's
    StatefulSet and headless Service (Kubernetes), or the group's job file, HCL or JSON (Nomad). Its
    name is <prefix>-<id> (switchboard-pp-a); the groups are named <prefix>-0, <prefix>-1, ..."""

    @field_validator("usage_db")
    @classmethod
    def _usage_db(cls, v: str | None) -> str | None:
        from data_plane.ledger.store import check_usage_db

        return check_usage_db(v)

    @model_validator(mode="after")
    def _check_replicas(self) -> ControlPlaneSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.pipeline_group_template is not None and self.actuator == "local":
            raise ValueError(
                "pipeline_group_template is for the kubernetes and nomad actuators; the local one scales "
                "groups of --pipeline-parallel-size stage processes given in --shard-args"
            )
        return self

    @field_validator("services", mode="before")
    @classmethod
    def _split_services(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(s.strip() for s in value.split(",") if s.strip())
        return value

    @field_validator("services")
    @classmethod
    def _check_services(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one service name is needed")
        for name in value:
            if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 64:
                raise ValueError(f"bad service name {name!r}")
        return value
