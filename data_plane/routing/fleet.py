"""The router's incremental view of the shards: what a routing decision reads, kept up to date on
membership change instead of being recomputed per request.

    fleet = ShardFleet()
    fleet.sync(membership.members("shard"))          # on change only: O(changed) ring update
    fleet.acquire("shard-3"); fleet.release("shard-3")  # outstanding requests, per zone sums too
    scope = fleet.scope(skip=frozenset())             # the candidates of one decision (O(1) to make)
    scope.ring_choice("sess-1", epsilon=0.25)         # bounded-load walk from the key, stops early
    scope.two_choices(rng)                            # power of two choices, sampled, no scan

Used by the router (data_plane/routing/router.py) and its policies (routing/policies.py,
routing/kv_routing.py). Per request nothing here scans the fleet: the ring is a sorted array of
virtual-node points (:class:`FastRing`, the same points and walk as
:class:`~data_plane.membership.hashring.HashRing`) searched with one binary search; the bounded-load
cap comes from running load sums (total and per zone); ejected and excluded shards are a small
``skip`` set the walk steps over. So a decision costs the same at 10 shards as at 10,000
(`switchboard bench route`). A membership change adds or removes only the changed nodes' points
(a few milliseconds at 10,000 shards); each node's 128 points are hashed once and kept.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from data_plane.membership.hashring import DEFAULT_VNODES, stable_hash
from data_plane.membership.view import Member, routing_key

_FULL_REBUILD_FRACTION = 0.25
"""A change touching more than this share of the nodes rebuilds the ring instead of patching it."""
_WALK_CHUNK = 16


class FastRing:
    """Consistent hashing over numpy arrays of points; nodes are added and removed in place.

    Same points as HashRing (``stable_hash(f"{node}#{i}")``), same clockwise walk over distinct
    nodes, so both agree on every key (a 64-bit point collision, ~1e-7 at 1.28M points, may be
    broken differently)."""

    def __init__(self, vnodes: int = DEFAULT_VNODES, points: dict[str, np.ndarray] | None = None) -> None:
        self.vnodes = vnodes
        self._points = points if points is not None else {}
        self._hashes = np.empty(0, dtype=np.uint64)
        self._owners = np.empty(0, dtype=np.int64)
        self._slot: dict[str, int] = {}
        self._node_at: list[str | None] = []
        self._free: list[int] = []
        self.builds = 0
        """Full rebuilds; patches (add/remove) are counted in :attr:`patches`."""
        self.patches = 0

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, node: object) -> bool:
        return node in self._slot

    def points_of(self, node: str) -> np.ndarray:
        pts = self._points.get(node)
        if pts is None:
            pts = np.array([stable_hash(f"{node}#{i}") for i in range(self.vnodes)], dtype=np.uint64)
            pts.sort()
            self._points[node] = pts
        return pts

    def update(self, nodes: Iterable[str]) -> bool:
        """Make the ring hold exactly `nodes`; True if it changed."""
        want = set(nodes)
        gone = [n for n in self._slot if n not in want]
        new = sorted(n for n in want if n not in self._slot)
        if not gone and not new:
            return False
        if not self._slot or len(gone) + len(new) > max(8, _FULL_REBUILD_FRACTION * len(want)):
            self._rebuild(sorted(want))
            return True
        for node in gone:
            self._remove(node)
        for node in new:
            self._add(node)
        self.patches += 1
        return True

    def _rebuild(self, nodes: list[str]) -> None:
        self._slot = {n: i for i, n in enumerate(nodes)}
        self._node_at = list(nodes)
        self._free = []
        if nodes:
            hashes = np.concatenate([self.points_of(n) for n in nodes])
            owners = np.repeat(np.arange(len(nodes), dtype=np.int64), self.vnodes)
            order = np.lexsort((owners, hashes))
            self._hashes, self._owners = hashes[order], owners[order]
        else:
            self._hashes, self._owners = np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64)
        self.builds += 1

    def _add(self, node: str) -> None:
        slot = self._free.pop() if self._free else len(self._node_at)
        if slot == len(self._node_at):
            self._node_at.append(node)
        else:
            self._node_at[slot] = node
        self._slot[node] = slot
        pts = self.points_of(node)
        at = np.searchsorted(self._hashes, pts, side="right")
        self._hashes = np.insert(self._hashes, at, pts)
        self._owners = np.insert(self._owners, at, slot)

    def _remove(self, node: str) -> None:
        slot = self._slot.pop(node)
        keep = self._owners != slot
        self._hashes, self._owners = self._hashes[keep], self._owners[keep]
        self._node_at[slot] = None
        self._free.append(slot)
        self._points.pop(node, None)

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes clockwise from `key`'s point, each once (lazily: stop when you like)."""
        total = len(self._hashes)
        if not total:
            return
        pos = int(np.searchsorted(self._hashes, np.uint64(stable_hash(key)), side="right")) % total
        seen: set[int] = set()
        distinct, visited = len(self._slot), 0
        node_at, owners = self._node_at, self._owners
        while visited < total:
            end = min(pos + _WALK_CHUNK, total)
            for slot in owners[pos:end].tolist():
                if slot not in seen:
                    seen.add(slot)
                    yield node_at[slot]  # type: ignore[misc]  # live slots only hold node ids
                    if len(seen) == distinct:
                        return
            visited += end - pos
            pos = end % total


class ShardFleet:
    """Routable shards indexed for constant-cost choice (see the module docstring)."""

    def __init__(self, vnodes: int = DEFAULT_VNODES) -> None:
        self._points: dict[str, np.ndarray] = {}
        self.vnodes = vnodes
        self.by_id: dict[str, Member] = {}
        self.ordered: tuple[Member, ...] = ()
        self.zone_of: dict[str, str] = {}
        self.zone_members: dict[str, tuple[Member, ...]] = {}
        self.ring = FastRing(vnodes, self._points)
        self.zone_rings: dict[str, FastRing] = {}
        self.loads: dict[str, int] = {}
        """Outstanding requests per shard id (also of shards that left while requests ran)."""
        self.zone_load: dict[str, int] = {}
        self.total_load = 0
        self.changes = 0
        """Membership changes applied (each updates the rings once)."""
        self.cost: Callable[[str, int], float] | None = None
        """(shard id, outstanding) -> what power of two choices compares (routing/latency.py: latency x
        (outstanding + 1)); None: outstanding requests alone."""
        self._last: Sequence[Member] | None = None

    def __len__(self) -> int:
        return len(self.by_id)

    def sync(self, members: Sequence[Member]) -> bool:
        """Adopt `members` (routable shards); True if anything a decision reads changed."""
        if members is self._last:
            return False
        if self._last is not None and len(members) == len(self._last) and members == self._last:
            self._last = members
            return False
        self._last = members
        fresh = {m.id: m for m in members}
        # Heartbeat times are no change: every shard's moves between two listings, so comparing the
        # members whole rebuilt the rings (and logged "routing view") each time any other member's
        # meta changed, e.g. a cache node's kv_bytes every 10 s under load.
        if fresh.keys() == self.by_id.keys() and all(routing_key(m) == routing_key(self.by_id[i])
                                                     for i, m in fresh.items()):
            return False
        self.by_id = fresh
        self.ordered = tuple(sorted(fresh.values(), key=lambda m: m.id))
        self.zone_of = {m.id: m.zone for m in self.ordered}
        zones: dict[str, list[Member]] = {}
        for m in self.ordered:
            zones.setdefault(m.zone, []).append(m)
        self.zone_members = {z: tuple(ms) for z, ms in zones.items()}
        self.ring.update(fresh)
        for z in list(self.zone_rings):
            if z not in zones:
                del self.zone_rings[z]
        if len(zones) > 1:
            for z, ms in zones.items():
                # Zone rings share the point cache, so their nodes are hashed once too.
                self.zone_rings.setdefault(z, FastRing(self.vnodes, self._points)).update(m.id for m in ms)
        else:
            self.zone_rings.clear()
        self._points_gc()
        self._resum()
        self.changes += 1
        return True

    def _points_gc(self) -> None:
        for node in [n for n in self._points if n not in self.by_id]:
            del self._points[node]

    def _resum(self) -> None:
        self.zone_load = {z: 0 for z in self.zone_members}
        total = 0
        for mid, n in self.loads.items():
            z = self.zone_of.get(mid)
            if z is not None:
                self.zone_load[z] += n
                total += n
        self.total_load = total

    def acquire(self, member_id: str) -> None:
        self.loads[member_id] = self.loads.get(member_id, 0) + 1
        z = self.zone_of.get(member_id)
        if z is not None:
            self.zone_load[z] += 1
            self.total_load += 1

    def release(self, member_id: str) -> None:
        n = self.loads.get(member_id, 0) - 1
        if n > 0:
            self.loads[member_id] = n
        else:
            self.loads.pop(member_id, None)
        z = self.zone_of.get(member_id)
        if z is not None:
            self.zone_load[z] -= 1
            self.total_load -= 1

    def scope(self, skip: frozenset[str] | set[str], zone: str | None = None) -> Scope:
        """The candidates of one decision: every shard (or zone `zone`'s) except `skip`."""
        if zone is None:
            n, total, ring, members = len(self.by_id), self.total_load, self.ring, self.ordered
        else:
            members = self.zone_members.get(zone, ())
            n, total = len(members), self.zone_load.get(zone, 0)
            ring = self.zone_rings.get(zone, self.ring)
        for mid in skip:
            z = self.zone_of.get(mid)
            if z is not None and (zone is None or z == zone):
                n -= 1
                total -= self.loads.get(mid, 0)
        return Scope(self, ring, members, skip, zone, n, total)


class Scope:
    """The candidate shards of one routing decision (made per request; holds no copies)."""

    __slots__ = ("fleet", "members", "n", "ring", "skip", "total", "zone")

    def __init__(self, fleet: ShardFleet, ring: FastRing, members: Sequence[Member],
                 skip: frozenset[str] | set[str], zone: str | None, n: int, total: int) -> None:
        self.fleet, self.ring, self.members, self.skip, self.zone = fleet, ring, members, skip, zone
        self.n, self.total = n, total

    def ok(self, member_id: str) -> bool:
        """Is `member_id` one of the candidates?"""
        z = self.fleet.zone_of.get(member_id)
        return z is not None and member_id not in self.skip and (self.zone is None or z == self.zone)

    def member(self, member_id: str) -> Member:
        return self.fleet.by_id[member_id]

    def load(self, member_id: str) -> int:
        return self.fleet.loads.get(member_id, 0)

    def cap(self, epsilon: float) -> int:
        """``ceil((1 + epsilon) * (total + 1) / n)`` over the candidates (Mirrokni et al.)."""
        if self.n <= 0:
            return 1 << 30
        # The tiny slack keeps float noise (1.1 * 10 = 11.000000000000002) from adding one.
        return math.ceil((1.0 + epsilon) * (self.total + 1) / self.n - 1e-9)

    def ring_choice(self, key: str, epsilon: float) -> Member:
        """The first candidate on `key`'s ring walk whose load + 1 stays within the cap."""
        cap = self.cap(epsilon)
        loads, skip = self.fleet.loads, self.skip
        for node in self.ring.walk(key):
            if node not in skip and loads.get(node, 0) + 1 <= cap:
                return self.fleet.by_id[node]
        return self._least_loaded()  # unreachable for epsilon >= 0: the least loaded fits

    def two_choices(self, rng: random.Random) -> Member:
        """The less loaded of two random candidates (power of two choices), without a scan."""
        members, skip = self.members, self.skip
        if self.n <= 1 or len(members) < 2:
            return self._least_loaded()
        picked: list[Member] = []
        for _ in range(32):  # rejection sampling: skip is small next to the fleet
            m = members[rng.randrange(len(members))]
            if m.id in skip or (picked and picked[0].id == m.id):
                continue
            picked.append(m)
            if len(picked) == 2:
                return self._cheaper(*picked)
        ok = [m for m in members if m.id not in skip]
        a, b = rng.sample(ok, 2)
        return self._cheaper(a, b)

    def _cheaper(self, a: Member, b: Member) -> Member:
        cost = self.fleet.cost
        if cost is None:
            return a if self.load(a.id) <= self.load(b.id) else b
        return a if cost(a.id, self.load(a.id)) <= cost(b.id, self.load(b.id)) else b

    def _least_loaded(self) -> Member:
        ok = [m for m in self.members if m.id not in self.skip]
        if not ok:
            raise LookupError("no candidate shard")
        return min(ok, key=lambda m: (self.load(m.id), m.id))
