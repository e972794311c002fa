"""KV-aware routing: send a conversation's turn where its KV already is, unless that costs more.

    router = Router(membership, metrics, policy="kv_aware")        # --routing-policy kv_aware
    shard = router.pick(session_id="s-1")                          # holder, ring choice, or other
    router.observe_kv("s-1", shard.id, prompt_tokens)              # after routing a turn there

The router remembers, from its own decisions, which shard holds each session's KV and about how
many tokens of it (:class:`KVIndex`, a bounded LRU: approximate by design). For a turn it weighs
two candidates, Dynamo-style: the shard holding the session's KV and the consistent-hash ring's
bounded-load choice (today's session affinity). Cost = tokens still to prefill + ``load_cost_tokens``
per outstanding request, so the holder wins unless it is loaded enough that recomputing elsewhere
is cheaper; a holder above the bounded-load cap is never chosen, and a holder that is gone (dead,
drained, ejected) is simply not a candidate: the ring picks, and the turn recomputes its prefix.
When holder and ring agree this *is* session affinity; they differ after membership changes (the
ring moved the session, its KV did not move) and under overload.

Not (yet) known to the index: the shards' evictions (a holder that evicted the session's blocks
still looks warm until the next turn lands elsewhere) and prefixes shared between sessions.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import TYPE_CHECKING

from opentelemetry import trace

from data_plane.routing.policies import AffinityPolicy

if TYPE_CHECKING:
    from data_plane.membership.view import Member

DEFAULT_LOAD_COST_TOKENS = 128.0
"""One outstanding request on a shard costs as much as prefilling this many tokens."""
DEFAULT_MAX_SESSIONS = 100_000
"""Sessions the index remembers (LRU beyond)."""

OUTCOME_HOLDER = "holder"
"""The turn went to the shard holding its KV (the ring agreed or was outweighed)."""
OUTCOME_RING = "ring"
"""No known KV for the session (or its holder is gone): the ring's choice."""
OUTCOME_OVERLOADED = "holder_overloaded"
"""The holder was above the load cap or too loaded for its cached tokens: recompute elsewhere."""


class KVIndex:
    """session id -> (shard id, cached tokens), least recently used forgotten first."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._where: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def record(self, session_id: str, shard_id: str, tokens: int) -> None:
        self._where[session_id] = (shard_id, tokens)
        self._where.move_to_end(session_id)
        while len(self._where) > self.max_sessions:
            self._where.popitem(last=False)

    def holder(self, session_id: str) -> tuple[str, int] | None:
        return self._where.get(session_id)

    def __len__(self) -> int:
        return len(self._where)


class KVAwarePolicy:
    """Expected cached tokens against load between the KV holder and the ring's choice."""

    name = "kv_aware"

    def __init__(self, epsilon: float, rng: random.Random, *, load_cost_tokens: float = DEFAULT_LOAD_COST_TOKENS,
                 index: KVIndex | None = None) -> None:
        self.epsilon = epsilon
        self.ring = AffinityPolicy(epsilon, rng)
        self.load_cost_tokens = load_cost_tokens
        self.index = index or KVIndex()
        self.last_outcome = OUTCOME_RING
        self.last_expected_cached = 0

    def choose(self, candidates: list[Member], session_id: str | None, loads: dict[str, int]) -> Member:
        ring_choice = self.ring.choose(candidates, session_id, loads)
        self.last_outcome, self.last_expected_cached = OUTCOME_RING, 0
        known = self.index.holder(session_id) if session_id else None
        if known is None:
            return ring_choice
        holder_id, tokens = known
        if holder_id == ring_choice.id:
            self.last_outcome, self.last_expected_cached = OUTCOME_HOLDER, tokens
            return ring_choice
        holder = next((m for m in candidates if m.id == holder_id), None)
        if holder is None:
            return ring_choice  # dead, drained or ejected: its KV is out of reach
        cap = self.ring.load_cap(loads)
        w = self.load_cost_tokens
        holder_cost = w * loads.get(holder.id, 0) - tokens
        ring_cost = w * loads.get(ring_choice.id, 0)
        if loads.get(holder.id, 0) + 1 > cap or holder_cost > ring_cost:
            self.last_outcome = OUTCOME_OVERLOADED
            trace.get_current_span().add_event("router.kv_moved", {"tokens_lost": tokens})
            return ring_choice
        self.last_outcome, self.last_expected_cached = OUTCOME_HOLDER, tokens
        return holder

    def observe(self, session_id: str, shard_id: str, tokens: int) -> None:
        self.index.record(session_id, shard_id, tokens)
