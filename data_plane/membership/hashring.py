"""Consistent hashing with virtual nodes, and consistent hashing with bounded loads.

    ring = HashRing(["cache-a", "cache-b", "cache-c"])
    ring.preference_list("session-42", 2)        # ['cache-b', 'cache-a']: owner, then next
    ring.bounded_load_choice("session-42", {"cache-b": 9, "cache-a": 1}, epsilon=0.25)

Each node is placed at ``vnodes`` points on a 64-bit ring; a key belongs to the first point
clockwise from its own hash, and its preference list continues clockwise over distinct nodes.
Adding or removing one of N nodes moves only about 1/N of the keys, and only to or from
that node.

:meth:`HashRing.bounded_load_choice` is Mirrokni, Thorup and Zadimoghaddam's "consistent
hashing with bounded loads" (2018): walk the ring from the key and take the first node whose
load would stay within ``ceil((1 + epsilon) * (total + 1) / n)``. Keys keep their affinity
while a node is under the cap and spill to the next node on the ring when it is not.

Hashes are blake2b, so every process (whatever its ``PYTHONHASHSEED``) builds the same ring.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping

DEFAULT_VNODES = 128


def stable_hash(value: str) -> int:
    """A 64-bit hash that is the same in every process and on every machine."""
    return int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """An immutable ring of node ids; build a new one when membership changes (it is cheap)."""

    def __init__(self, nodes: Iterable[str], vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self._nodes: tuple[str, ...] = tuple(sorted(set(nodes)))
        self.vnodes = vnodes
        points = sorted((stable_hash(f"{node}#{i}"), node) for node in self._nodes for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct node ids on the ring, sorted."""
        return self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes in ring order starting at `key`'s owner; each node exactly once."""
        if not self._hashes:
            return
        start = bisect.bisect_right(self._hashes, stable_hash(key))
        seen: set[str] = set()
        total = len(self._owners)
        for i in range(total):
            node = self._owners[(start + i) % total]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._nodes):
                    return

    def preference_list(self, key: str, n: int) -> list[str]:
        """The first `n` distinct nodes for `key` in ring order (all nodes if fewer than `n`)."""
        if n <= 0:
            return []
        out: list[str] = []
        for node in self.walk(key):
            out.append(node)
            if len(out) == n:
                break
        return out

    def bounded_load_choice(self, key: str, loads: Mapping[str, int], epsilon: float) -> str:
        """The first node on `key`'s walk whose load + 1 stays within the bounded-load cap.

        `loads` maps node id to its current load (missing means 0; ids not on the ring are
        ignored). With ``epsilon >= 0`` some node always fits, since the least loaded node is
        at or below the average. Raises ``LookupError`` on an empty ring.
        """
        if epsilon < 0:
            raise ValueError("epsilon must be >= 0")
        if not self._nodes:
            raise LookupError("the hash ring has no nodes")
        cap = self.load_cap(loads, epsilon)
        for node in self.walk(key):
            if loads.get(node, 0) + 1 <= cap:
                return node
        # Unreachable for epsilon >= 0 (see docstring); fall back to the least loaded node.
        return min(self._nodes, key=lambda n: (loads.get(n, 0), n))

    def load_cap(self, loads: Mapping[str, int], epsilon: float) -> int:
        """``ceil((1 + epsilon) * (total + 1) / n)`` over the nodes on this ring."""
        total = sum(max(0, loads.get(node, 0)) for node in self._nodes)
        # The tiny slack keeps float noise (1.1 * 10 = 11.000000000000002) from adding one.
        return math.ceil((1.0 + epsilon) * (total + 1) / len(self._nodes) - 1e-9)
