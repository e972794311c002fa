"""KV-aware routing: send a conversation's turn where its KV already is, unless that costs more.

    router = Router(membership, metrics, policy="kv_aware")        # --routing-policy kv_aware
    shard = router.pick(session_id="s-1")                          # holder, ring choice, or other
    router.observe_kv("s-1", shard.id, prompt_tokens, chain)       # after routing a turn there
    router.kv_reports.request_headers(shard.id)                    # {"x-switchboard-kv-since": "41"}
    router.kv_reports.read(shard.id, response.header)              # the shard's eviction reports

The router remembers, from its own decisions, which shard holds each session's KV and about how
many tokens of it, plus the holder before that (:class:`KVIndex`, a bounded LRU: approximate by
design). For a turn it weighs, Dynamo-style, the consistent-hash ring's bounded-load choice
(today's session affinity) against the holders: cost = ``load_cost_tokens`` per outstanding
request minus the tokens expected cached there. The holder wins unless it is loaded enough that
recomputing elsewhere is cheaper; a holder past twice the bounded-load cap is never chosen (within
that the cost decides: spreading a conversation away from its KV costs its whole history); a holder
that is gone (dead, drained, ejected) or overloaded hands the turn to the best other shard: the
previous holder (an older prefix of the same conversation) when it is cheaper, else the ring's
choice. When holder and ring agree this *is* session affinity; they differ after membership
changes (the ring moved the session, its KV did not move) and under overload.

Evictions: each shard names the prompt's last cached block on its response headers (a chain id,
data_plane/common/kv_report.py) and reports the chain ids it has since evicted on later responses
(:class:`KVReports`, one cursor per shard, so several gateways each get every report); the index
then forgets that shard as the session's holder (LRU eviction is tail first, so the prompt's last
block going means the session's KV there is no longer whole).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry import trace

from data_plane.common.kv_report import EVICTED_HEADER, SINCE_HEADER, parse_evicted

if TYPE_CHECKING:
    from data_plane.membership.view import Member
    from data_plane.routing.fleet import Scope

DEFAULT_LOAD_COST_TOKENS = 128.0
"""One outstanding request on a shard costs as much as prefilling this many tokens."""
DEFAULT_HOLDER_CAP_FACTOR = 2.0
"""A shard holding the session's KV may take it up to this many times the bounded-load cap: within
that, the cost (cached tokens against load) decides, not the ring's balance rule."""
DEFAULT_MAX_SESSIONS = 100_000
"""Sessions the index remembers (LRU beyond)."""

OUTCOME_HOLDER = "holder"
"""The turn went to the shard holding its KV (the ring agreed or was outweighed)."""
OUTCOME_RING = "ring"
"""No known KV for the session: the ring's choice."""
OUTCOME_OVERLOADED = "holder_overloaded"
"""The holder was above the load cap or too loaded for its cached tokens: the ring's choice."""
OUTCOME_GONE = "holder_gone"
"""The holder is dead, drained or ejected: the ring's choice (the prefix is recomputed)."""
OUTCOME_PREVIOUS = "previous_holder"
"""The holder was gone or overloaded; the shard that held the conversation before was cheaper."""
OUTCOMES = (OUTCOME_HOLDER, OUTCOME_RING, OUTCOME_OVERLOADED, OUTCOME_GONE, OUTCOME_PREVIOUS)


class _Entry:
    __slots__ = ("chain", "prev_chain", "prev_shard", "prev_tokens", "shard", "tokens")

    def __init__(self, shard: str, tokens: int, chain: str | None) -> None:
        self.shard, self.tokens, self.chain = shard, tokens, chain
        self.prev_shard: str | None = None
        self.prev_tokens = 0
        self.prev_chain: str | None = None


class KVIndex:
    """session id -> (shard, cached tokens, chain id) and the holder before; LRU beyond `max_sessions`.

    ``(shard, chain id) -> session`` is kept alongside, so an eviction report costs one lookup."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._where: OrderedDict[str, _Entry] = OrderedDict()
        self._by_chain: dict[tuple[str, str], str] = {}

    def record(self, session_id: str, shard_id: str, tokens: int, chain: str | None = None) -> None:
        e = self._where.get(session_id)
        if e is None:
            e = self._where[session_id] = _Entry(shard_id, tokens, None)
        elif e.shard != shard_id:
            self._unlink(e.prev_shard, e.prev_chain)
            e.prev_shard, e.prev_tokens, e.prev_chain = e.shard, e.tokens, e.chain
            if e.prev_shard == shard_id:  # back where it was: no older holder left
                self._unlink(e.prev_shard, e.prev_chain)
                e.prev_shard, e.prev_tokens, e.prev_chain = None, 0, None
            e.shard, e.tokens, e.chain = shard_id, tokens, None
        else:
            e.tokens = tokens
        if chain is not None and chain != e.chain:
            self._unlink(shard_id, e.chain)
            e.chain = chain
            self._by_chain[(shard_id, chain)] = session_id
        self._where.move_to_end(session_id)
        while len(self._where) > self.max_sessions:
            _, old = self._where.popitem(last=False)
            self._unlink(old.shard, old.chain)
            self._unlink(old.prev_shard, old.prev_chain)

    def _unlink(self, shard: str | None, chain: str | None) -> None:
        if shard is not None and chain is not None:
            self._by_chain.pop((shard, chain), None)

    def holder(self, session_id: str) -> tuple[str, int] | None:
        e = self._where.get(session_id)
        return (e.shard, e.tokens) if e is not None and e.tokens > 0 else None

    def holders(self, session_id: str) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
        """((holder, tokens), (previous holder, tokens)), each None when not known (or evicted)."""
        e = self._where.get(session_id)
        if e is None:
            return None, None
        cur = (e.shard, e.tokens) if e.tokens > 0 else None
        prev = (e.prev_shard, e.prev_tokens) if e.prev_shard is not None and e.prev_tokens > 0 else None
        return cur, prev

    def evicted(self, shard_id: str, chain: str) -> bool:
        """`shard_id` evicted the block named `chain`: forget it as that session's holder."""
        session = self._by_chain.pop((shard_id, chain), None)
        e = self._where.get(session) if session is not None else None
        if e is None:
            return False
        if e.shard == shard_id and e.chain == chain:
            e.tokens, e.chain = 0, None
        elif e.prev_shard == shard_id and e.prev_chain == chain:
            e.prev_shard, e.prev_tokens, e.prev_chain = None, 0, None
        else:
            return False
        return True

    def __len__(self) -> int:
        return len(self._where)


class KVReports:
    """Reads shards' eviction reports off chat responses; one cursor per shard (bounded by the fleet)."""

    def __init__(self, index: KVIndex, on_forgotten: Callable[[int], None] = lambda n: None) -> None:
        self.index = index
        self.on_forgotten = on_forgotten
        self._seen: dict[str, int] = {}

    def request_headers(self, shard_id: str) -> dict[str, str]:
        return {SINCE_HEADER: str(self._seen.get(shard_id, 0))}

    def read(self, shard_id: str, header: Callable[[bytes], bytes | None]) -> int:
        """Apply the reports on one response (`header`: name -> value); returns sessions forgotten."""
        report = parse_evicted(header(EVICTED_HEADER.encode()))
        if report is None:
            return 0
        seq, chains = report
        if len(self._seen) > 4 * max(1, len(self.index)) + 1024:
            self._seen.clear()  # shards come and go; a lost cursor only repeats a few reports
        self._seen[shard_id] = seq
        forgotten = sum(1 for chain in chains if self.index.evicted(shard_id, chain))
        if forgotten:
            self.on_forgotten(forgotten)
            trace.get_current_span().add_event("router.kv_evicted", {"shard": shard_id, "sessions": forgotten})
        return forgotten


class KVAwarePolicy:
    """Expected cached tokens against load between the KV holders and the ring's choice."""

    name = "kv_aware"

    def __init__(self, epsilon: float, rng: random.Random, *, load_cost_tokens: float = DEFAULT_LOAD_COST_TOKENS,
                 holder_cap_factor: float = DEFAULT_HOLDER_CAP_FACTOR, index: KVIndex | None = None) -> None:
        self.epsilon = epsilon
        self.rng = rng
        self.load_cost_tokens = load_cost_tokens
        self.holder_cap_factor = holder_cap_factor
        self.index = index or KVIndex()
        self.reports = KVReports(self.index)
        self.last_outcome = OUTCOME_RING
        self.last_expected_cached = 0

    def choose(self, scope: Scope, session_id: str | None) -> Member:
        self.last_outcome, self.last_expected_cached = OUTCOME_RING, 0
        if not session_id:
            return scope.two_choices(self.rng)
        ring = scope.ring_choice(session_id, self.epsilon)
        cur, prev = self.index.holders(session_id)
        if cur is None and prev is None:
            return ring
        w, cap = self.load_cost_tokens, self.holder_cap_factor * scope.cap(self.epsilon)
        cached = dict(x for x in (prev, cur) if x is not None)  # cur last: it wins on one shard
        best, best_tokens = ring, cached.get(ring.id, 0)
        best_cost = w * scope.load(ring.id) - best_tokens
        holder_state = None
        for rank, known in enumerate((cur, prev)):
            if known is None or known[0] == ring.id or (rank and cur is not None and known[0] == cur[0]):
                continue
            if rank and best is not ring:
                break  # the holder itself won: the older prefix is not considered
            shard, tokens = known
            cost = w * scope.load(shard) - tokens
            if not scope.ok(shard):
                state = OUTCOME_GONE  # dead, drained or ejected: its KV is out of reach
            elif scope.load(shard) + 1 > cap or cost > best_cost or (rank and cost == best_cost):
                state = OUTCOME_OVERLOADED
            else:
                best, best_tokens, best_cost, state = scope.member(shard), tokens, cost, ""
            if rank == 0:
                holder_state = state
        if cur is not None and best.id == cur[0]:
            outcome = OUTCOME_HOLDER
        elif prev is not None and best.id == prev[0]:
            outcome = OUTCOME_PREVIOUS
        else:
            outcome = holder_state or OUTCOME_RING
        if cur is not None and outcome != OUTCOME_HOLDER:
            trace.get_current_span().add_event("router.kv_moved", {
                "reason": outcome, "tokens_lost": max(0, cur[1] - best_tokens), "shard": best.id})
        self.last_outcome, self.last_expected_cached = outcome, best_tokens
        return best

    def observe(self, session_id: str, shard_id: str, tokens: int, chain: str | None = None) -> None:
        self.index.record(session_id, shard_id, tokens, chain)
