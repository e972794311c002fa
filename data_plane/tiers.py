"""The one tier policy: who is served first, how much, and how safely.

Read by both planes: the gateway (auth, rate limits, admission, chat) serves by it; the control
plane stores, validates and serves it (control_plane/policy_store.py, the admin API's ``/tiers``).

    policy = TierPolicy.default()                    # free / plus / enterprise
    policy = TierPolicy.from_yaml("tiers.yaml")      # or YAML text; ValueError names the bad field
    tier = policy.get(principal.tier)                # KeyError naming the known tiers
    tier.priority, tier.rpm, tier.max_output_tokens  # lower priority is served first

An operator's file has one mapping per tier under ``tiers`` (every field required)::

    tiers:
      free:       {priority: 2, rpm: 60,   tpm: 20000,  max_context_tokens: 2048,
                   max_output_tokens: 256,  replication: 1, shed_order: 0, safety: default}
      enterprise: {priority: 0, rpm: 6000, tpm: 2000000, max_context_tokens: 32768,
                   max_output_tokens: 2048, replication: 2, shed_order: 2}

``safety`` (optional, default ``"default"``) names a policy in
:class:`data_plane.gateway.safety.pipeline.SafetyPolicies`. Context limits are further capped by the served
model's own context window at the gateway. ``to_dict()`` returns the same shape, so
``TierPolicy.from_dict(policy.to_dict()) == policy``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data_plane.common.yaml_source import load_yaml

TIER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Tier names are short identifiers: they appear as metric labels and in config files."""


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int
    """Admission priority; lower is served first (enterprise 0, plus 1, free 2)."""
    rpm: int
    """Requests per minute per API key."""
    tpm: int
    """Tokens (prompt + completion) per minute per API key."""
    max_context_tokens: int
    """Longest prompt context kept for a request (capped again by the model's context)."""
    max_output_tokens: int
    """Upper bound on max_tokens for one completion."""
    replication: int
    """How many cache nodes hold each session transcript (1..5)."""
    shed_order: int
    """Load shedding order under degradation: the lowest value is shed first."""
    safety: str = "default"
    """Name of the safety policy applied to this tier's requests and responses."""


class _TierSpec(BaseModel):
    """Validation for one tier (the dataclass stays a plain internal value)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    priority: int = Field(ge=0, le=1000)
    # bounded: a limit of 10**400 was stored, and a request without max_tokens was then a 429 "needs 10**400 tokens"
    rpm: int = Field(gt=0, le=1_000_000_000)
    tpm: int = Field(gt=0, le=1_000_000_000_000)
    max_context_tokens: int = Field(gt=0, le=100_000_000)
    max_output_tokens: int = Field(gt=0, le=100_000_000)
    replication: int = Field(ge=1, le=5)
    shed_order: int = Field(ge=0, le=1000)
    safety: str = Field(default="default", min_length=1, max_length=64)


class _PolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tiers: dict[str, _TierSpec] = Field(min_length=1)


_DEFAULT_TIERS = (
    Tier("free", priority=2, rpm=60, tpm=20_000, max_context_tokens=2048,
         max_output_tokens=256, replication=1, shed_order=0),
    Tier("plus", priority=1, rpm=600, tpm=200_000, max_context_tokens=8192,
         max_output_tokens=1024, replication=2, shed_order=1),
    Tier("enterprise", priority=0, rpm=6000, tpm=2_000_000, max_context_tokens=32768,
         max_output_tokens=2048, replication=2, shed_order=2),
)


def _validation_message(exc: ValidationError, loc_prefix: str = "") -> str:
    # Only loc and msg: pydantic's input_value could be anything an operator typed.
    parts = []
    for err in exc.errors():
        loc = ".".join([loc_prefix] * bool(loc_prefix) + [str(p) for p in err.get("loc", ())])
        parts.append(f"{loc or 'value'}: {err.get('msg', 'invalid value')}")
    return "invalid tier policy: " + "; ".join(parts)


class TierPolicy:
    """An immutable mapping of tier name to :class:`Tier`, in the order it was declared."""

    def __init__(self, tiers: Iterable[Tier]) -> None:
        by_name: dict[str, Tier] = {}
        for tier in tiers:
            if tier.name in by_name:
                raise ValueError(f"tier {tier.name!r} is defined twice")
            _check_tier(tier)
            by_name[tier.name] = tier
        if not by_name:
            raise ValueError("a tier policy needs at least one tier")
        self._tiers = by_name

    @classmethod
    def default(cls) -> TierPolicy:
        return cls(_DEFAULT_TIERS)

    @classmethod
    def from_dict(cls, data: Any) -> TierPolicy:
        """Build from ``{"tiers": {name: {field: value}}}``; ValueError names the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"tier policy: expected a mapping with 'tiers', got {type(data).__name__}")
        try:
            spec = _PolicySpec.model_validate(data)
        except ValidationError as exc:
            raise ValueError(_validation_message(exc)) from None
        return cls(Tier(name=name, **t.model_dump()) for name, t in spec.tiers.items())

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> TierPolicy:
        """Read a YAML file (a Path, or a str naming one) or YAML text."""
        return cls.from_dict(load_yaml(text_or_path))

    def get(self, name: str) -> Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise KeyError(f"unknown tier {name!r}; known tiers: {', '.join(self._tiers)}") from None

    def names(self) -> list[str]:
        return list(self._tiers)

    def to_dict(self) -> dict[str, Any]:
        tiers = {}
        for tier in self._tiers.values():
            fields = asdict(tier)
            del fields["name"]
            tiers[tier.name] = fields
        return {"tiers": tiers}

    def __getitem__(self, name: str) -> Tier:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tiers

    def __iter__(self) -> Iterator[str]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TierPolicy):
            return NotImplemented
        return self._tiers == other._tiers

    def __hash__(self) -> int:
        return hash(frozenset(self._tiers.values()))

    def __repr__(self) -> str:
        return f"TierPolicy({list(self._tiers.values())!r})"


def _check_tier(tier: Tier) -> None:
    if not isinstance(tier.name, str) or not re.fullmatch(TIER_NAME_PATTERN, tier.name):
        raise ValueError(
            f"tier name {str(tier.name)[:64]!r} is not valid: use 1-64 letters, digits, '_', '.', '-'"
        )
    fields = asdict(tier)
    del fields["name"]
    try:
        _TierSpec.model_validate(fields)
    except ValidationError as exc:
        raise ValueError(_validation_message(exc, f"tiers.{tier.name}")) from None


SAFETY_META = "safety_policies"
"""A gateway's registration metadata: the safety policies it serves, comma-separated (each gateway loads its
own, data_plane/gateway/safety/pipeline.py); a gateway refuses a tier policy that names another."""


def unserved_safety(policy: TierPolicy, gateways: Iterable[tuple[str, Mapping[str, str]]]) -> str | None:
    """Why the gateways (id, registration metadata) would refuse `policy`: a tier's ``safety`` that one of them
    does not serve; None when each serves them all (a gateway that does not say what it serves is not asked)."""
    wanted = {policy[name].safety for name in policy}
    for member_id, meta in gateways:
        if SAFETY_META not in meta:
            continue
        served = set(filter(None, meta[SAFETY_META].split(",")))
        if missing := sorted(wanted - served):
            return (f"tier policy names safety policies {missing} that gateway {member_id} does not serve (it serves "
                    f"{sorted(served)}): it would keep the policy in force instead")
    return None
