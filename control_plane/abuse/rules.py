"""The abuse rules: numbers in, findings out (no I/O, no clock, no text).

    findings = evaluate(config, recent, baseline, auth_failures)
    # recent / baseline: per key and error code (data_plane/ledger/store.py KeyActivity), over the
    # last window and over the baseline period before it; auth_failures: {address: count} in the window

Called by the monitor (control_plane/abuse/monitor.py) once per interval. The thresholds and what
each rule means are in control_plane/abuse/model.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from control_plane.abuse.model import AbuseConfig, Finding, Rule
from data_plane.ledger.store import KeyActivity

BLOCKED_CODE = "content_policy_violation"
"""The input (or output) filter refused the request (data_plane/common/errors.py)."""
SESSION_404_CODE = "session_not_found"
NOT_THE_CLIENTS = frozenset({
    "", "overloaded", "no_healthy_backend", "upstream_error", "upstream_timeout", "internal_error",
    "cache_unavailable", "not_ready", "client_closed_request", "rate_limit_exceeded", "abuse_throttled",
    "abuse_blocked", "address_banned", BLOCKED_CODE, SESSION_404_CODE,
})
"""Codes the `errors` rule does not count: answered, the platform's own failures, limits already
applied, and what other rules count."""


@dataclass
class _KeyTotals:
    tenant: str = ""
    requests: int = 0
    tokens: int = 0
    blocked: int = 0
    session_404s: int = 0
    errors: int = 0


def _totals(rows: Iterable[KeyActivity]) -> dict[str, _KeyTotals]:
    out: dict[str, _KeyTotals] = defaultdict(_KeyTotals)
    for row in rows:
        t = out[row.key_id]
        t.tenant = row.tenant
        t.requests += row.requests
        t.tokens += row.tokens
        if row.error_code == BLOCKED_CODE:
            t.blocked += row.requests
        elif row.error_code == SESSION_404_CODE:
            t.session_404s += row.requests
        elif row.error_code not in NOT_THE_CLIENTS:
            t.errors += row.requests
    return out


def evaluate(config: AbuseConfig, recent: Iterable[KeyActivity], baseline: Iterable[KeyActivity],
             auth_failures: Mapping[str, int]) -> list[Finding]:
    """Every rule that fires, per subject (keys from the ledger, addresses from the gateways)."""
    now = _totals(recent)
    usual = _totals(baseline)
    scale = config.window_s / config.baseline_s if config.baseline_s else 0.0  # baseline -> one window
    found: list[Finding] = []
    for key, t in sorted(now.items()):
        base = usual.get(key, _KeyTotals())
        req_bar = max(config.burst_min_requests, config.burst_factor * base.requests * scale)
        tok_bar = max(config.burst_min_tokens, config.burst_factor * base.tokens * scale)
        if t.requests >= req_bar:
            found.append(Finding(Rule.BURST, key, t.requests, req_bar, t.tenant, base.requests * scale))
        elif t.tokens >= tok_bar:
            found.append(Finding(Rule.BURST, key, t.tokens, tok_bar, t.tenant, base.tokens * scale, tokens=True))
        for rule, observed, bar in ((Rule.BLOCKED_PROMPTS, t.blocked, config.blocked_prompts),
                                    (Rule.SESSION_PROBING, t.session_404s, config.session_404s),
                                    (Rule.ERRORS, t.errors, config.errors)):
            if bar and observed >= bar:
                found.append(Finding(rule, key, observed, bar, t.tenant))
    if config.auth_failures:
        for address, count in sorted(auth_failures.items()):
            if count >= config.auth_failures:
                found.append(Finding(Rule.AUTH_FAILURES, address, count, config.auth_failures))
    return found


__all__ = ["BLOCKED_CODE", "NOT_THE_CLIENTS", "SESSION_404_CODE", "evaluate"]
