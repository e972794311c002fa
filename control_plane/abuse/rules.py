"""The abuse rules: numbers in, findings out (no I/O, no clock, no text).

    findings = evaluate(config, recent, baseline, auth_failures, baseline_end=now - config.window_s)
    # recent / baseline: per key and error code (data_plane/ledger/store.py KeyActivity), over the
    # last window and over the baseline period before it; auth_failures: {address: count} in the window

Called by the monitor (control_plane/abuse/monitor.py) once per interval. The thresholds and what
each rule means are in control_plane/abuse/model.py.

A subject's *usual* count per window is its count over the baseline period divided by the part of
that period it was active in (from its first request in the period to ``baseline_end``, at least one
window), times the window: a key that started an hour ago at a steady 1,000 a window has a usual
1,000, not the 1,000 x 12 / 288 a flat day would give it. A subject with no history has a usual 0,
and only the rule's floor stands between it and a finding.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from control_plane.abuse.model import AbuseConfig, Finding, Rule, Subject
from data_plane.common.disconnect import CLIENT_DISCONNECTED
from data_plane.ledger.store import KeyActivity

BLOCKED_CODE = "content_policy_violation"
"""The input (or output) filter refused the request (data_plane/common/errors.py)."""
SESSION_404_CODE = "session_not_found"
NOT_THE_CLIENTS = frozenset({
    "", "overloaded", "no_healthy_backend", "upstream_error", "upstream_timeout", "internal_error",
    "cache_unavailable", "not_ready", "model_unavailable", "model_loading", "cache_backend_unavailable",
    "grammar_compiler_busy", "pipeline_stage_lost", "rate_limit_exceeded", "abuse_throttled",
    "abuse_blocked", "address_banned", BLOCKED_CODE, SESSION_404_CODE, CLIENT_DISCONNECTED,
})
"""Codes the `errors` rule does not count: answered, the platform's own failures (every 5xx code the
gateway and shards write: overloaded and its finer codes, an upstream's failure), a client that left
before its answer (a user's "stop": the gateway's own constant, so the ledger's code and this list
cannot drift apart again; `abandoned` counts those), limits already applied, and what other rules count."""
REJECTED_CODES = frozenset({"abuse_throttled", "abuse_blocked"})
"""Requests the gateways refused under an abuse action: a key that keeps trying is keeping at it."""


@dataclass
class _Totals:
    tenant: str = ""
    requests: int = 0
    tokens: int = 0
    blocked: int = 0
    session_404s: int = 0
    errors: int = 0
    abandoned: int = 0
    rejected: int = 0
    first_at: float = math.inf
    """The first request's start (inf: unknown, taken as the start of the range)."""

    def add(self, row: KeyActivity) -> None:
        self.tenant = row.tenant
        self.requests += row.requests
        self.tokens += row.tokens
        if row.error_code == BLOCKED_CODE:
            self.blocked += row.requests
        elif row.error_code == SESSION_404_CODE:
            self.session_404s += row.requests
        elif row.error_code == CLIENT_DISCONNECTED:
            self.abandoned += row.requests
        elif row.error_code not in NOT_THE_CLIENTS:
            self.errors += row.requests
        if row.error_code in REJECTED_CODES:
            self.rejected += row.requests
        if row.first_at is not None:
            self.first_at = min(self.first_at, row.first_at)


def _totals(rows: Iterable[KeyActivity], by_tenant: bool = False) -> dict[str, _Totals]:
    out: dict[str, _Totals] = defaultdict(_Totals)
    for row in rows:
        if by_tenant and not row.tenant:
            continue
        out[row.tenant if by_tenant else row.key_id].add(row)
    return out


@dataclass(frozen=True)
class _Usual:
    """A subject's usual counts per window (see the module docstring)."""

    requests: float = 0.0
    tokens: float = 0.0
    session_404s: float = 0.0
    errors: float = 0.0
    abandoned: float = 0.0

    @classmethod
    def of(cls, t: _Totals | None, config: AbuseConfig, baseline_end: float | None) -> _Usual:
        if t is None or not config.baseline_s:
            return cls()
        span = config.baseline_s
        if baseline_end is not None and math.isfinite(t.first_at):
            span = min(span, max(config.window_s, baseline_end - t.first_at))
        scale = config.window_s / span if span else 0.0
        return cls(t.requests * scale, t.tokens * scale, t.session_404s * scale, t.errors * scale,
                   t.abandoned * scale)


def _bar(floor: float, factor: float, usual: float) -> float:
    return max(float(floor), factor * usual)


def _key_findings(config: AbuseConfig, key: str, t: _Totals, u: _Usual) -> list[Finding]:
    found: list[Finding] = []
    req_bar = _bar(config.burst_min_requests, config.burst_factor, u.requests)
    tok_bar = _bar(config.burst_min_tokens, config.burst_factor, u.tokens)
    if t.requests >= req_bar:
        found.append(Finding(Rule.BURST, key, t.requests, req_bar, t.tenant, u.requests))
    elif t.tokens >= tok_bar:
        found.append(Finding(Rule.BURST, key, t.tokens, tok_bar, t.tenant, u.tokens, tokens=True))
    if config.blocked_prompts and t.blocked >= config.blocked_prompts:  # never usual: no baseline
        found.append(Finding(Rule.BLOCKED_PROMPTS, key, t.blocked, config.blocked_prompts, t.tenant))
    for rule, observed, floor, usual in ((Rule.SESSION_PROBING, t.session_404s, config.session_404s, u.session_404s),
                                         (Rule.ERRORS, t.errors, config.errors, u.errors)):
        bar = _bar(floor, config.baseline_factor, usual)
        if floor and observed >= bar:
            found.append(Finding(rule, key, observed, bar, t.tenant, usual))
    bar = _bar(config.abandoned, config.baseline_factor, u.abandoned)
    if config.abandoned and t.abandoned >= bar and t.abandoned >= config.abandoned_share * t.requests:
        found.append(Finding(Rule.ABANDONED, key, t.abandoned, bar, t.tenant, u.abandoned))
    return found


def _tenant_findings(config: AbuseConfig, tenant: str, t: _Totals, u: _Usual) -> list[Finding]:
    found: list[Finding] = []
    req_bar = _bar(config.tenant_burst_min_requests, config.burst_factor, u.requests)
    tok_bar = _bar(config.tenant_burst_min_tokens, config.burst_factor, u.tokens)
    if config.tenant_burst_min_requests and t.requests >= req_bar:
        found.append(Finding(Rule.TENANT_BURST, tenant, t.requests, req_bar, tenant, u.requests))
    elif config.tenant_burst_min_tokens and t.tokens >= tok_bar:
        found.append(Finding(Rule.TENANT_BURST, tenant, t.tokens, tok_bar, tenant, u.tokens, tokens=True))
    bar = _bar(config.tenant_session_404s, config.baseline_factor, u.session_404s)
    if config.tenant_session_404s and t.session_404s >= bar:
        found.append(Finding(Rule.TENANT_SESSION_PROBING, tenant, t.session_404s, bar, tenant, u.session_404s))
    return found


def evaluate(config: AbuseConfig, recent: Iterable[KeyActivity], baseline: Iterable[KeyActivity],
             auth_failures: Mapping[str, int], baseline_end: float | None = None) -> list[Finding]:
    """Every rule that fires, per subject (keys and tenants from the ledger, addresses from the
    gateways). `baseline_end`: where the baseline period ends (the window's start); without it a
    subject's usual rate is taken over the whole baseline period."""
    recent, baseline = list(recent), list(baseline)
    found: list[Finding] = []
    usual = _totals(baseline)
    for key, t in sorted(_totals(recent).items()):
        found += _key_findings(config, key, t, _Usual.of(usual.get(key), config, baseline_end))
    usual = _totals(baseline, by_tenant=True)
    for tenant, t in sorted(_totals(recent, by_tenant=True).items()):
        found += _tenant_findings(config, tenant, t, _Usual.of(usual.get(tenant), config, baseline_end))
    if config.auth_failures:
        for address, count in sorted(auth_failures.items()):
            if count >= config.auth_failures:
                found.append(Finding(Rule.AUTH_FAILURES, address, count, config.auth_failures))
    return found


def tail_totals(rows: Iterable[KeyActivity]) -> dict[str, _Totals]:
    """Per key, what it did over the last ``escalate_after_s`` (for :func:`kept_at_it`)."""
    return _totals(rows)


def kept_at_it(config: AbuseConfig, f: Finding, tail: Mapping[str, _Totals]) -> bool:
    """Whether the subject of a finding whose action is in force kept at it over the last
    ``escalate_after_s`` (`tail`), which an action's next step takes besides the rule still firing:
    a key that stopped is not punished twice for what is still in the window. A burst: its rate
    over the tail (refused requests too) still reaches the bar; the other key rules: at least one
    more of what the rule counts, or a request the gateways refused under the action. One-step
    ladders (addresses, tenants, ``errors``) never climb, so they are not asked."""
    if f.rule.subject is not Subject.KEY:
        return True
    t = tail.get(f.subject)
    if t is None:
        return False
    if f.rule is Rule.BURST:
        span = min(config.escalate_after_s, config.window_s)
        scale = config.window_s / span if span else 1.0
        return (t.tokens if f.tokens else t.requests) * scale >= f.threshold
    counted = {Rule.BLOCKED_PROMPTS: t.blocked, Rule.SESSION_PROBING: t.session_404s,
               Rule.ABANDONED: t.abandoned}.get(f.rule, t.errors)
    return counted + t.rejected > 0


__all__ = ["BLOCKED_CODE", "NOT_THE_CLIENTS", "REJECTED_CODES", "SESSION_404_CODE", "evaluate", "kept_at_it",
           "tail_totals"]
