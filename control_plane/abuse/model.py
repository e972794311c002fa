"""The abuse monitor's vocabulary: rules, responses, events, actions, and the documented thresholds.

    config = AbuseConfig.from_file("abuse.yaml")      # or AbuseConfig() for the defaults below
    Rule.BURST.ladder                                 # (FLAG, THROTTLE, BLOCK): how it escalates
    Response.BLOCK.outranks(Response.THROTTLE)        # True

Used by control_plane/abuse/rules.py (detection), monitor.py (escalation, expiry, review) and api.py
(the wire). A rule fires on numbers only (counts of requests, tokens, error codes from the usage
ledger, authentication failures per address from the gateways): never on a prompt's text, which
the monitor never sees and never stores.

Thresholds (defaults; every one is a field of :class:`AbuseConfig`, set from a YAML file with
``switchboard control-plane --abuse-rules FILE``):

A key's or tenant's *usual* count is its rate over the ``baseline_s`` (24 h) before the window, over the
part of that period it was active in (control_plane/abuse/rules.py), scaled to one window; each
relative rule fires at ``max(floor, factor x usual)``, so a key that always sends a lot is not
flagged for it, and a new key (usual 0) only past the floor.

| rule | subject | fires when, over the last ``window_s`` (300 s) | ladder |
|---|---|---|---|
| ``burst`` | key | requests >= max(``burst_min_requests`` 600, ``burst_factor`` 10 x usual), or tokens >= max(``burst_min_tokens`` 500,000, 10 x usual) | flag, throttle, block |
| ``blocked_prompts`` | key | prompts refused by the input filter >= ``blocked_prompts`` 5 (absolute: a refused prompt is never usual) | strict checks, block |
| ``session_probing`` | key | ``session_not_found`` answers >= max(``session_404s`` 10, ``baseline_factor`` 10 x usual) (guessing other conversations' ids) | flag, throttle, block |
| ``errors`` | key | other 4xx answers >= max(``errors`` 100, ``baseline_factor`` 10 x usual) | flag |
| ``abandoned`` | key | requests its client left before the answer ended (``client_disconnected``) >= max(``abandoned`` 100, ``baseline_factor`` 10 x usual), and at least ``abandoned_share`` 0.5 of its requests: prompts sent for the prefill they cost, never read (a soak's abusive tenant: 62 % of all prefill on 18 % of the requests, mostly abandoned, and no rule saw it) | flag, throttle |
| ``tenant_burst`` | tenant | all its keys' requests >= max(``tenant_burst_min_requests`` 3,000, ``burst_factor`` x the tenant's usual), or tokens (``tenant_burst_min_tokens`` 2,500,000): a burst spread over many keys, each below its own bar | flag |
| ``tenant_session_probing`` | tenant | all its keys' ``session_not_found`` >= max(``tenant_session_404s`` 30, ``baseline_factor`` x usual): probing spread over keys | flag |
| ``auth_failures`` | address | 401s from one source address >= ``auth_failures`` 10 (the address behind trusted proxies: the gateway's ``--trusted-proxies``) | ban |

A tenant's rules only flag (for an operator to review): acting on a whole tenant is an operator's
call. A floor of 0 turns its rule off.

A rule that still fires ``escalate_after_s`` (60 s) after its last step takes the next one if the
key kept at it over those 60 s (a burst: its rate over them, refused requests too, still reaches
the bar; the other rules: one more of what they count, or a request refused under the action); a
key that stopped stays at its step until it expires. Each
action expires (``durations_s``); an operator can lift one (the rule then counts only what comes
after the lift) or confirm it (held for ``confirm_hold_s``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


class Subject(enum.Enum):
    """What an action applies to."""

    KEY = "key"
    ADDRESS = "address"
    TENANT = "tenant"


class Response(enum.Enum):
    """What the gateways do, mildest first."""

    FLAG = "flag"
    """Listed for review; traffic untouched."""
    STRICT = "strict"
    """The strict input filter policy and a lower output cap."""
    THROTTLE = "throttle"
    """A tighter rate limit (``throttle_rpm``): 429 + Retry-After past it."""
    BLOCK = "block"
    """Every request: 429 + Retry-After with a clear message."""
    BAN = "ban"
    """An address: its requests without a valid key 403 + Retry-After (its bad keys still counted); a valid key
    from it is served."""

    @property
    def rank(self) -> int:
        return list(Response).index(self)

    def outranks(self, other: Response) -> bool:
        return self.rank > other.rank


class Rule(enum.Enum):
    """Why an event was raised (the metric's label)."""

    BURST = "burst"
    BLOCKED_PROMPTS = "blocked_prompts"
    SESSION_PROBING = "session_probing"
    ERRORS = "errors"
    ABANDONED = "abandoned"
    TENANT_BURST = "tenant_burst"
    TENANT_SESSION_PROBING = "tenant_session_probing"
    AUTH_FAILURES = "auth_failures"

    @property
    def subject(self) -> Subject:
        if self is Rule.AUTH_FAILURES:
            return Subject.ADDRESS
        return Subject.TENANT if self in (Rule.TENANT_BURST, Rule.TENANT_SESSION_PROBING) else Subject.KEY

    @property
    def ladder(self) -> tuple[Response, ...]:
        return LADDERS[self]


LADDERS: dict[Rule, tuple[Response, ...]] = {
    Rule.BURST: (Response.FLAG, Response.THROTTLE, Response.BLOCK),
    Rule.BLOCKED_PROMPTS: (Response.STRICT, Response.BLOCK),
    Rule.SESSION_PROBING: (Response.FLAG, Response.THROTTLE, Response.BLOCK),
    Rule.ERRORS: (Response.FLAG,),
    Rule.ABANDONED: (Response.FLAG, Response.THROTTLE),
    Rule.TENANT_BURST: (Response.FLAG,),
    Rule.TENANT_SESSION_PROBING: (Response.FLAG,),
    Rule.AUTH_FAILURES: (Response.BAN,),
}


class Review(enum.Enum):
    """Where an action stands with the operators."""

    PENDING = "pending"
    CONFIRMED = "confirmed"


@dataclass(frozen=True)
class Finding:
    """A rule that fired for one subject, with the numbers that made it fire."""

    rule: Rule
    subject: str
    observed: float
    threshold: float
    tenant: str = ""
    baseline: float = 0.0
    tokens: bool = False
    """A burst of tokens rather than of requests."""

    @property
    def reason(self) -> str:
        if self.rule in (Rule.BURST, Rule.TENANT_BURST):
            unit = "tokens" if self.tokens else "requests"
            whose = " from all the tenant's keys" if self.rule is Rule.TENANT_BURST else ""
            return (f"{self.observed:g} {unit}{whose} in the window, usually {self.baseline:.3g} "
                    f"(threshold {self.threshold:g})")
        what = {Rule.BLOCKED_PROMPTS: "prompts refused by the input filter",
                Rule.SESSION_PROBING: "requests for sessions that do not exist (session id probing)",
                Rule.TENANT_SESSION_PROBING: "requests for sessions that do not exist from all the tenant's keys "
                                             "(session id probing)",
                Rule.ERRORS: "rejected requests (4xx)",
                Rule.ABANDONED: "requests abandoned before their answer ended (most of the key's: prefill never read)",
                Rule.AUTH_FAILURES: "failed authentications from this address"}[self.rule]
        usual = "" if self.rule in (Rule.BLOCKED_PROMPTS, Rule.AUTH_FAILURES) else f", usually {self.baseline:.3g}"
        return f"{self.observed:g} {what}{usual} (threshold {self.threshold:g})"


@dataclass(frozen=True)
class Event:
    """One rule firing, as recorded (an audit line: numbers and ids, no text)."""

    id: int
    at: float
    rule: Rule
    subject_kind: Subject
    subject: str
    tenant: str
    reason: str
    response: Response
    """The step this event led to."""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at, "rule": self.rule.value, "subject_kind": self.subject_kind.value,
                "subject": self.subject, "tenant": self.tenant, "reason": self.reason, "response": self.response.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(int(d["id"]), float(d["at"]), Rule(d["rule"]), Subject(d["subject_kind"]), str(d["subject"]),
                   str(d["tenant"]), str(d["reason"]), Response(d["response"]))


@dataclass(frozen=True)
class Action:
    """A response in force for one subject until `expires_at` (or an operator lifts it)."""

    id: int
    subject_kind: Subject
    subject: str
    tenant: str
    rule: Rule
    response: Response
    reason: str
    created_at: float
    expires_at: float
    review: Review = Review.PENDING

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "subject_kind": self.subject_kind.value, "subject": self.subject, "tenant": self.tenant,
                "rule": self.rule.value, "response": self.response.value, "reason": self.reason,
                "created_at": self.created_at, "expires_at": self.expires_at, "review": self.review.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Action:
        return cls(int(d["id"]), Subject(d["subject_kind"]), str(d["subject"]), str(d["tenant"]), Rule(d["rule"]),
                   Response(d["response"]), str(d["reason"]), float(d["created_at"]), float(d["expires_at"]),
                   Review(d["review"]))


def _default_durations() -> dict[str, float]:
    return {"flag": 3600.0, "strict": 900.0, "throttle": 600.0, "block": 300.0, "ban": 600.0}


@dataclass(frozen=True)
class AbuseConfig:
    """Thresholds and timings of the abuse monitor (see the module docstring's table)."""

    interval_s: float = 5.0
    """Seconds between evaluations."""
    window_s: float = 300.0
    """The recent window every rule counts over."""
    baseline_s: float = 86400.0
    """The history a key's usual rate is taken from (before the window)."""
    burst_factor: float = 10.0
    """A burst is this many times the key's (or tenant's) usual count in a window..."""
    burst_min_requests: int = 600
    """...and at least this many requests in the window (new keys have no baseline; 2 a second)."""
    burst_min_tokens: int = 500_000
    """...or at least this many tokens in the window."""
    blocked_prompts: int = 5
    session_404s: int = 10
    """The floor of ``session_probing`` (its bar: this, or ``baseline_factor`` x the key's usual)."""
    errors: int = 100
    """The floor of ``errors`` (likewise)."""
    abandoned: int = 100
    """The floor of ``abandoned`` (likewise; 0: off)."""
    abandoned_share: float = 0.5
    """...which also needs this share of the key's requests in the window abandoned (a chat app whose users
    press stop now and then stays far below it)."""
    baseline_factor: float = 10.0
    """How far past its usual count a key's session 404s or errors must go (the floors still apply)."""
    tenant_burst_min_requests: int = 3000
    """The floor of ``tenant_burst`` in requests (0: off)."""
    tenant_burst_min_tokens: int = 2_500_000
    """The floor of ``tenant_burst`` in tokens (0: off)."""
    tenant_session_404s: int = 30
    """The floor of ``tenant_session_probing`` (0: off)."""
    auth_failures: int = 10
    escalate_after_s: float = 60.0
    """A rule still firing this long after its last step, its key having kept at it meanwhile, takes the next one."""
    durations_s: dict[str, float] = field(default_factory=_default_durations)
    """How long each response lasts (by Response value)."""
    confirm_hold_s: float = 86400.0
    """A confirmed action is held this long from the confirmation."""
    throttle_rpm: int = 6
    """Requests per minute a throttled key may send."""
    strict_max_output_tokens: int = 256
    """The output cap under strict checks."""
    max_events: int = 1000
    """Events kept in memory (newest)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"abuse config: {f.name} must be >= 0")
        unknown = set(self.durations_s) - {r.value for r in Response}
        if unknown:
            raise ValueError(f"abuse config: durations_s for unknown responses {sorted(unknown)}")

    def duration(self, response: Response) -> float:
        return float(self.durations_s.get(response.value, _default_durations()[response.value]))

    @classmethod
    def from_file(cls, path: str | Path) -> AbuseConfig:
        from data_plane.common.yaml_source import parse_yaml

        data = parse_yaml(Path(path).read_text(), str(path)) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of abuse thresholds")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown abuse settings {sorted(unknown)}; known: {sorted(known)}")
        base = cls()
        durations = {**base.durations_s, **data.pop("durations_s", {})}
        return replace(base, durations_s=durations, **data)


__all__ = ["LADDERS", "AbuseConfig", "Action", "Event", "Finding", "Response", "Review", "Rule", "Subject"]
