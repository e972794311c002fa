"""Shard-choice policies: consistent hashing with bounded loads, and power of two choices.

    policy = AffinityPolicy(epsilon=0.25, rng=random.Random())
    member = policy.choose(fleet.scope(skip), session_id="s-123")    # routing/fleet.py: candidates

The router (data_plane/routing/router.py) picks one by name; the KV-aware policy
(data_plane/routing/kv_routing.py) builds on :class:`AffinityPolicy` for the ring's choice.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from data_plane.membership.view import Member
    from data_plane.routing.fleet import Scope


class Policy(Protocol):
    name: str

    def choose(self, scope: Scope, session_id: str | None) -> Member:
        """One of `scope`'s candidates (data_plane/routing/fleet.py: no per-request scan)."""
        ...


class AffinityPolicy:
    """Consistent hashing on the session id with bounded loads (falls back to P2C without one)."""

    name = "affinity"

    def __init__(self, epsilon: float, rng: random.Random) -> None:
        self.epsilon = epsilon
        self.rng = rng

    def choose(self, scope: Scope, session_id: str | None) -> Member:
        if not session_id:
            return scope.two_choices(self.rng)
        return scope.ring_choice(session_id, self.epsilon)


class LeastLoadedPolicy:
    """Power of two choices on outstanding requests."""

    name = "least_loaded"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, scope: Scope, session_id: str | None) -> Member:
        return scope.two_choices(self.rng)
