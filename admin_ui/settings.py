"""Settings of the admin console, parsed once per console process.

    settings = ConsoleSettings.from_argv(["--control-plane-url", "http://127.0.0.1:8300"])
    settings.admin_token_value()      # env, then .switchboard/credentials.json, else None

Every field reads a flag (``--control-plane-url``) or an environment variable
(``SWITCHBOARD_CONTROL_PLANE_URL``); flags win. The admin token is read from
``SWITCHBOARD_ADMIN_TOKEN`` (shared with the control plane) or from the ``admin_token`` field of
the credentials file that ``switchboard up`` writes; it is never taken as a flag, so it stays
out of ``ps``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from data_plane.common.settings_cli import build_parser as settings_parser
from data_plane.gateway.auth import key_digest
from data_plane.gateway.keys_cli import up_state_dir

ENV_CONTROL_PLANE_URL = "SWITCHBOARD_CONTROL_PLANE_URL"
"""Base URL of the control plane's admin API."""
ENV_GATEWAY_URL = "SWITCHBOARD_GATEWAY_URL"
"""Base URL of the chat gateway (the Playground sends chats there)."""
ENV_ADMIN_TOKEN = "SWITCHBOARD_ADMIN_TOKEN"
"""Bearer token of the admin API (same variable as the control plane's)."""
ENV_CREDENTIALS_FILE = "SWITCHBOARD_CREDENTIALS_FILE"
"""Credentials written by ``switchboard up``: ``{"keys": {tier: key}, "admin_token": ...}``."""
ENV_KEYS_FILE = "SWITCHBOARD_CONSOLE_KEYS_FILE"
"""The gateways' keys file (``switchboard up``'s ``keys.yaml``), read for which dev keys are still live."""
ENV_REFRESH_S = "SWITCHBOARD_CONSOLE_REFRESH_S"
"""Seconds between automatic refreshes of the live parts of each page."""
ENV_LOGIN_CODE = "SWITCHBOARD_CONSOLE_LOGIN_CODE"
"""The one-time login link's code (``/?token=CODE``), minted per start by ``switchboard console`` or
``switchboard up`` (admin_ui/login.py); environment only, never a flag."""

DEFAULT_CREDENTIALS_FILE = "$SWITCHBOARD_UP_STATE_DIR/credentials.json, else .switchboard/credentials.json"
"""Where the credentials are looked for by default (said in --help): where `switchboard keys` finds its keys file."""


def default_credentials_file() -> str:
    """`switchboard up`'s credentials.json in its state dir (keys_cli.up_state_dir)."""
    return str(up_state_dir() / "credentials.json")


class ConsoleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_CONSOLE_", extra="ignore", populate_by_name=True,
                                      frozen=True, use_attribute_docstrings=True)
    FLAG_ALIASES: ClassVar[dict[str, str]] = {"--refresh": "refresh_s"}
    """Deprecated flag spellings."""
    ENV_ONLY: ClassVar[frozenset[str]] = frozenset({"admin_token", "login_code"})
    """Never a flag: the secrets stay out of ``ps``."""

    control_plane_url: str = Field(
        default="http://127.0.0.1:8300", validation_alias=AliasChoices("control_plane_url", ENV_CONTROL_PLANE_URL)
    )
    """The control plane the console steers (admin API under ``/admin/v1``)."""
    gateway_url: str = Field(
        default="http://127.0.0.1:8000", validation_alias=AliasChoices("gateway_url", ENV_GATEWAY_URL)
    )
    """The gateway the Playground sends chats to."""
    admin_token: SecretStr | None = Field(default=None, validation_alias=AliasChoices("admin_token", ENV_ADMIN_TOKEN))
    """Admin bearer token; falls back to the credentials file's ``admin_token``."""
    credentials_file: str = Field(
        default_factory=default_credentials_file, validation_alias=AliasChoices("credentials_file", ENV_CREDENTIALS_FILE)
    )
    """Where ``switchboard up`` saved the dev API keys and the admin token (a client credential, mode 600)."""
    keys_file: str | None = Field(default=None, validation_alias=AliasChoices("keys_file", ENV_KEYS_FILE))
    """The gateways' keys file (digests): the Playground offers only the dev keys it still lists, so a
    revoked key disappears at once. Unset (a console away from the gateways' files): every dev key."""
    refresh_s: float = Field(default=3.0, ge=0.5, le=300.0, validation_alias=AliasChoices("refresh_s", ENV_REFRESH_S))
    """Seconds between automatic refreshes."""
    timeout_s: float = Field(default=3.0, gt=0.0, le=60.0)
    """Timeout of one admin-API call; an unreachable control plane is reported after this long."""
    port: int = Field(default=8501, ge=1, le=65535)
    """Port the console serves on (read by `switchboard console`, which starts Streamlit)."""
    host: str = Field(default="127.0.0.1")
    """Address the console binds. Anything but loopback needs TLS (SWITCHBOARD_TLS_CERT/KEY) or
    --allow-insecure-http: the login form takes the admin token."""
    allow_insecure_http: bool = False
    """Serve a non-loopback --host over plain HTTP (only behind a proxy that terminates TLS): the admin
    token typed into the login form then crosses the network in clear text. Warned about at start."""
    session_ttl_s: float = Field(default=12 * 3600.0, ge=60.0, le=30 * 86400.0)
    """Seconds a login lasts; a browser session is logged out after this long, and at once when the
    admin token the console reads changes."""
    login_code: SecretStr | None = Field(default=None, validation_alias=AliasChoices("login_code", ENV_LOGIN_CODE))
    """The one-time login link's code (admin_ui/login.py): minted per start by `switchboard console`
    or `switchboard up`, handed down in the environment."""

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> ConsoleSettings:
        """Flags override the environment; unknown arguments (Streamlit's own) are ignored."""
        ns, _ = build_parser().parse_known_args(argv or [])
        return cls(**{k: v for k, v in vars(ns).items() if v is not None})

    def credentials(self) -> dict[str, Any]:
        """The credentials file as a dict; ``{}`` if it is missing or unreadable."""
        try:
            data = json.loads(Path(self.credentials_file).expanduser().read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def admin_token_value(self) -> str | None:
        if self.admin_token is not None and self.admin_token.get_secret_value():
            return self.admin_token.get_secret_value()
        token = self.credentials().get("admin_token")
        return str(token) if token else None

    def dev_keys(self) -> dict[str, str]:
        """``{tier: api key}`` from the credentials file (the Playground's choice of caller), less any key
        the keys file (when set) no longer lists under that tier: read on every call, so a key revoked
        with ``switchboard keys revoke`` is not offered, and an unreadable keys file offers none."""
        keys = self.credentials().get("keys")
        found = {str(k): str(v) for k, v in keys.items()} if isinstance(keys, dict) else {}
        if self.keys_file is None:
            return found
        live = live_digests(Path(self.keys_file).expanduser())
        return {tier: key for tier, key in found.items() if live.get(key_digest(key)) == tier}


def build_parser(prog: str = "switchboard console") -> argparse.ArgumentParser:
    """The console's flags, one per field (data_plane/common/settings_cli.py); none for the token."""
    return settings_parser(ConsoleSettings, prog, "The Switchboard admin console (Streamlit).")


def live_digests(path: Path) -> dict[str, str]:
    """``{sha256 hex: tier}`` of every entry of a gateway keys file; ``{}`` if it is missing or invalid."""
    from data_plane.common.yaml_source import parse_yaml
    from data_plane.gateway.auth import KeyStore

    try:
        keys = KeyStore.from_dict(parse_yaml(path.read_text(), str(path)), where=str(path))
    except (OSError, ValueError):
        return {}
    return {digest: p.tier for digest, p in keys.by_digest().items()}
