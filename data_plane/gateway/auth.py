"""API keys: who is calling, for which tenant, on which tier.

Built once by the gateway (data_plane/gateway/app.py) from its keys file and environment; every
request is authenticated against it. The dev launcher writes the development keys file, digests only
(control_plane/dev_credentials.py).

    keys = KeyStore.merged(KeyStore.from_yaml("keys.yaml"), KeyStore.from_env("sk-a:acme:plus"))
    keys.validate_tiers(tier_policy.names())            # at startup: ValueError on unknown tiers
    principal = keys.authenticate(request.headers.get("authorization"))
    principal.tenant, principal.tier, principal.key_id  # key_id is safe to log; the key is not

A keys file lists plaintext keys or, so operators need not store them, their SHA-256::

    keys:
      - {key: sk-sb-..., tenant: acme, tier: plus}
      - {key_sha256: 3f0a...e1 (64 hex digits), tenant: globex, tier: enterprise, name: ci-bot}

``switchboard keys create --tenant globex --tier enterprise`` makes a key and stores only its digest
(data_plane/gateway/keys_cli.py; ``name`` is an optional label the gateway ignores). The
environment form is ``key:tenant:tier`` entries separated by commas.

Every failure raises :class:`data_plane.common.errors.AuthenticationError` (401) with a message
that never contains the presented key or header.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from data_plane.common.errors import AuthenticationError
from data_plane.common.yaml_source import parse_yaml

log = logging.getLogger(__name__)

KEY_ID_LENGTH = 12
"""Hex digits of the key's SHA-256 kept as its public id (48 bits: unique in practice)."""
DEV_TENANT = "dev"
"""Tenant of the dev keys `switchboard up` creates (control_plane/dev_credentials.py)."""

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$"
"""What a tenant or tier name in a keys file must match."""
LABEL_PATTERN = r"^[^\x00-\x1f\x7f]{1,128}$"
"""An entry's optional ``name``: free text for operators, one printable line."""
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Principal:
    key_id: str
    """A short, non-secret id of the key (first hex digits of its SHA-256)."""
    tenant: str
    tier: str


def key_digest(key: str) -> str:
    """The hex SHA-256 of a key, as stored in ``key_sha256``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key(prefix: str = "sk-sb-") -> str:
    return prefix + secrets.token_urlsafe(32)


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    key: str | None = Field(default=None, min_length=1, max_length=512, pattern=r"^\S+$")
    key_sha256: str | None = None
    tenant: str = Field(pattern=NAME_PATTERN)
    tier: str = Field(pattern=NAME_PATTERN)
    name: str | None = Field(default=None, pattern=LABEL_PATTERN)

    @model_validator(mode="after")
    def _one_key(self) -> _KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("exactly one of 'key' or 'key_sha256' is required")
        if self.key_sha256 is not None and not _SHA256_HEX.match(self.key_sha256.lower()):
            raise ValueError("'key_sha256' must be 64 hexadecimal digits")
        return self

    def digest(self) -> str:
        return self.key_sha256.lower() if self.key_sha256 is not None else key_digest(self.key or "")


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[_KeyEntry] = Field(default_factory=list)


def _entry_errors(exc: ValidationError, where: str) -> str:
    # loc and msg only: input_value would echo a key into logs.
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc or 'entry'}: {err.get('msg', 'invalid value')}")
    return f"invalid API keys in {where}: " + "; ".join(parts)


class KeyStore:
    """An immutable set of API keys, held only as SHA-256 digests."""

    def __init__(self, principals: dict[str, Principal] | None = None) -> None:
        self._by_digest: dict[str, Principal] = dict(principals or {})

    @classmethod
    def _build(cls, entries: Iterable[tuple[str, str, str]], where: str) -> KeyStore:
        by_digest: dict[str, Principal] = {}
        for i, (digest, tenant, tier) in enumerate(entries):
            principal = Principal(key_id=digest[:KEY_ID_LENGTH], tenant=tenant, tier=tier)
            known = by_digest.get(digest)
            if known is not None and known != principal:
                raise ValueError(
                    f"invalid API keys in {where}: entry {i} (key id {principal.key_id}) is "
                    f"already assigned to tenant {known.tenant!r}, tier {known.tier!r}"
                )
            by_digest[digest] = principal
        return cls(by_digest)

    @classmethod
    def from_dict(cls, data: Any, where: str = "config") -> KeyStore:
        """Build from ``{"keys": [{"key" | "key_sha256", "tenant", "tier"}, ...]}``."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"invalid API keys in {where}: expected a mapping with 'keys'")
        try:
            spec = _KeysFile.model_validate(data)
        except ValidationError as exc:
            raise ValueError(_entry_errors(exc, where)) from None
        return cls._build(((e.digest(), e.tenant, e.tier) for e in spec.keys), where)

    @classmethod
    def from_yaml(cls, path: str | Path) -> KeyStore:
        path = Path(path)
        return cls.from_dict(parse_yaml(path.read_text(), str(path)), where=str(path))

    @classmethod
    def from_env(cls, value: str) -> KeyStore:
        """Parse ``"sk-a:tenant1:free,sk-b:tenant2:plus"`` (blank entries are skipped)."""
        entries = []
        for i, item in enumerate(value.split(",")):
            item = item.strip()
            if not item:
                continue
            # rsplit: a key may contain ':', tenants and tiers may not.
            parts = item.rsplit(":", 2)
            if len(parts) != 3:
                raise ValueError(
                    f"invalid API keys in environment: entry {i} is not 'key:tenant:tier'"
                )
            key, tenant, tier = parts
            entries.append({"key": key, "tenant": tenant, "tier": tier})
        return cls.from_dict({"keys": entries}, where="environment")

    @classmethod
    def merged(cls, *stores: KeyStore) -> KeyStore:
        """One store holding every key; a key given two different principals is a ValueError."""
        return cls._build(
            ((d, p.tenant, p.tier) for s in stores for d, p in s._by_digest.items()), "merged stores"
        )

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an ``Authorization: Bearer <key>`` header value, or 401."""
        if authorization is None or not authorization.strip():
            raise AuthenticationError("missing API key: send it as 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key or any(c.isspace() for c in key):
            raise AuthenticationError(
                "malformed Authorization header: expected 'Authorization: Bearer <key>'"
            )
        # A digest lookup compares attacker-unpredictable hashes, so its timing reveals
        # nothing usable about stored keys (the point of hmac.compare_digest).
        principal = self._by_digest.get(key_digest(key))
        if principal is None:
            raise AuthenticationError("invalid API key")
        return principal

    def validate_tiers(self, policy_names: Iterable[str]) -> None:
        """Raise ValueError naming every key whose tier is not in the tier policy."""
        known = set(policy_names)
        bad = sorted({(p.tier, p.key_id) for p in self._by_digest.values() if p.tier not in known})
        if bad:
            listed = ", ".join(f"key id {key_id} has tier {tier!r}" for tier, key_id in bad)
            raise ValueError(f"API keys name unknown tiers ({listed}); known tiers: {sorted(known)}")

    def principals(self) -> list[Principal]:
        return list(self._by_digest.values())

    def by_digest(self) -> dict[str, Principal]:
        """``{sha256 hex: principal}`` (a copy): digests are not secret; the keys are not here."""
        return dict(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"KeyStore({len(self)} keys)"
