"""Settings of the control-plane process, parsed once in `main()` and passed down.

    settings = ControlPlaneSettings(port=8300, admin_token="s3cret")
    app = create_app(settings)

Every field can be set by flag (see :func:`control_plane.app.main`) or by environment
variable: ``SWITCHBOARD_CONTROL_PLANE_<FIELD>`` (e.g. ``SWITCHBOARD_CONTROL_PLANE_PORT=8300``),
except the admin token, which every process that talks to the admin API shares as
:data:`ENV_ADMIN_TOKEN`. Flags win over the environment, the environment over defaults.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "SWITCHBOARD_CONTROL_PLANE_"
"""Prefix of the environment variables that configure the control plane."""
ENV_ADMIN_TOKEN = "SWITCHBOARD_ADMIN_TOKEN"
"""Bearer token that protects ``/admin/v1/...`` (shared with the admin console)."""

DEFAULT_SERVICES = ("shard", "cache", "gateway")


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", populate_by_name=True, frozen=True
    )

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = Field(default=8300, ge=1, le=65535)
    """TCP port of the registry and admin API."""
    admin_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("admin_token", ENV_ADMIN_TOKEN)
    )
    """Bearer token for ``/admin/v1/...``; without one the admin API answers 401 to everyone."""
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
    shutdown_grace_s: int = Field(default=5, ge=0, le=300)
    """Seconds in-flight requests get to finish on SIGTERM/SIGINT."""
    access_log: bool = False
    """Log every HTTP request (heartbeats make this noisy)."""

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
