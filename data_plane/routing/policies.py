"""Shard-choice policies: consistent hashing with bounded loads, and power of two choices.

    policy = AffinityPolicy(epsilon=0.25, rng=random.Random())
    member = policy.choose(candidates, session_id="s-123", loads={"shard-1": 2})

The router (data_plane/routing/router.py) picks one by name; the KV-aware policy
(data_plane/routing/kv_routing.py) builds on :class:`AffinityPolicy` for the ring's choice.
"""

from __future__ import annotations

import random
from typing import Protocol

from data_plane.membership.view import Member
from data_plane.membership.hashring import HashRing


class Policy(Protocol):
    name: str

    def choose(self, candidates: list[Member], session_id: str | None, loads: dict[str, int]) -> Member: ...


class AffinityPolicy:
    """Consistent hashing on the session id with bounded loads (falls back to P2C without one)."""

    name = "affinity"

    def __init__(self, epsilon: float, rng: random.Random) -> None:
        self.epsilon = epsilon
        self.fallback = LeastLoadedPolicy(rng)
        self._ring: HashRing | None = None

    def choose(self, candidates: list[Member], session_id: str | None, loads: dict[str, int]) -> Member:
        if not session_id:
            return self.fallback.choose(candidates, None, loads)
        ids = tuple(m.id for m in candidates)
        if self._ring is None or self._ring.nodes != tuple(sorted(ids)):
            self._ring = HashRing(ids)
        chosen = self._ring.bounded_load_choice(session_id, loads, self.epsilon)
        return next(m for m in candidates if m.id == chosen)

    def load_cap(self, loads: dict[str, int]) -> int:
        """The bounded-load cap over the ring's current nodes (after a choose with a session)."""
        return self._ring.load_cap(loads, self.epsilon) if self._ring is not None else 1 << 30


class LeastLoadedPolicy:
    """Power of two choices on outstanding requests."""

    name = "least_loaded"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, candidates: list[Member], session_id: str | None, loads: dict[str, int]) -> Member:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(candidates, 2)
        return a if loads.get(a.id, 0) <= loads.get(b.id, 0) else b
