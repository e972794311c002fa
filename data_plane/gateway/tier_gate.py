"""Refuse an API key whose tier the tier policy in force no longer has.

    gate = TierGate(registry)
    tier = gate.tier(principal, policy)      # the key's Tier, or 403 tier_removed

Why: the tier policy is hot (the control plane's ``PUT /admin/v1/tiers``, data_plane/gateway/cluster_state.py)
but the keys file names each key's tier. Deleting a tier from the policy left its keys served at the
definition the gateway started with (its ``--tiers-file`` or the built-in one): the operator's
"this tier is gone" had no effect, and the limits a key got depended on which gateway answered. A
deleted tier now refuses its keys on every route, at once, the way a revoked key is refused: 403
``permission_error`` / ``tier_removed``, naming the tier (never the key) so its owner knows what to
ask for. Restoring the tier, or moving the keys to another tier (``switchboard keys``), serves them
again. The keys are not dropped from the store: a policy change that is rolled back restores them.

Each refusal is counted in ``switchboard_gateway_tier_refusals_total{tier}`` (the tier names come
from the operator's keys file: bounded) and logged at WARNING once per key id a minute, with the key
id and the tier only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from data_plane.common.errors import PermissionDenied
from data_plane.tiers import Tier, TierPolicy

log = logging.getLogger(__name__)

CODE = "tier_removed"
"""The error's ``code`` (data_plane/gateway/metrics.py RequestCode.TIER_REMOVED)."""
LOG_EVERY_S = 60.0
"""A key that keeps calling is logged once a minute, not once a request."""
MAX_LOGGED = 10_000
"""Key ids remembered for the log's rate limit (beyond it, the oldest are forgotten)."""


class _Principal(Protocol):
    key_id: str
    tier: str


class TierGate:
    """The tier of an authenticated key, from the policy in force (see the module's docstring)."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.refusals = Counter("switchboard_gateway_tier_refusals",
                                "Requests refused because the API key's tier is not in the tier policy in force "
                                "(403 tier_removed).", ["tier"], registry=registry)
        self._clock = clock
        self._logged: dict[str, float] = {}

    def tier(self, principal: _Principal, policy: TierPolicy) -> Tier:
        if principal.tier in policy:
            return policy.get(principal.tier)
        self.refusals.labels(principal.tier).inc()
        self._log(principal)
        raise PermissionDenied(
            f"this API key's tier {principal.tier!r} is no longer offered (it was removed from the tier policy); "
            "the key is refused until the tier is restored or the key is moved to another tier: ask the "
            "platform's operators", code=CODE)

    def _log(self, principal: _Principal) -> None:
        now = self._clock()
        last = self._logged.get(principal.key_id)
        if last is not None and now - last < LOG_EVERY_S:
            return
        if len(self._logged) >= MAX_LOGGED:
            self._logged.pop(next(iter(self._logged)))
        self._logged.pop(principal.key_id, None)
        self._logged[principal.key_id] = now
        log.warning("refusing API key %s: its tier %r is not in the tier policy in force (403 %s)",
                    principal.key_id, principal.tier, CODE)


__all__ = ["CODE", "TierGate"]
