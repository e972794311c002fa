"""Zones: where members run, and how replicas and requests are spread over them.

    zone_of = {"cache-a1": "a", "cache-a2": "a", "cache-b1": "b"}
    replicas_across_zones(ring.walk("sess-1"), 2, zone_of)             # ['cache-a2', 'cache-b1']
    replicas_across_zones(ring.walk("sess-1"), 1, zone_of, local="b")  # ['cache-b1']: stays local
    local_first(["cache-a2", "cache-b1"], zone_of, "b")                 # ['cache-b1', 'cache-a2']

A zone is a failure domain (a rack, a datacenter, a cloud zone): every process takes ``--zone``
(default ``local``) and announces it in membership meta (``zone``). Used by the gateway's session
store (data_plane/cache/client.py) to place transcript replicas and by the router to prefer
shards of its own zone (data_plane/routing/router.py).

The placement rule, the same on every gateway whatever its own zone, so all gateways agree on
where a paid session lives:

- ``n >= 2`` replicas: walk the session's hash-ring preference order and take the first node of
  each zone not yet used; once every zone holding healthy nodes has one, fill up in walk order.
  With two zones, a paid session's two copies are always in different zones, so a zone outage
  leaves one.
- ``n == 1`` (free): the first node of the gateway's own zone on the walk, else the first node.
  A free session lives where its user is served and is lost with that zone.

Reads ask replicas in local-first order (:func:`local_first`): the same set, nearer copy first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

DEFAULT_ZONE = "local"
"""The zone of a process that was not told one."""
ZONE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
"""Zone names: short, lower-case, so they are safe as metric label values (bounded by config)."""


def replicas_across_zones(walk: Iterable[str], n: int, zone_of: Mapping[str, str],
                          local: str | None = None) -> list[str]:
    """The `n` replica nodes for a key whose ring walk is `walk` (distinct nodes, preference order).
    Reads the walk lazily: it stops once the answer is known."""
    if n <= 0:
        return []
    if n == 1:
        first: str | None = None
        for node in walk:
            if local is None or zone_of.get(node, DEFAULT_ZONE) == local:
                return [node]
            first = first or node
        return [first] if first is not None else []
    zones_total = len(set(zone_of.values())) or 1
    chosen: list[str] = []
    skipped: list[str] = []
    zones: set[str] = set()
    for node in walk:
        if len(zones) < zones_total:
            zone = zone_of.get(node, DEFAULT_ZONE)
            if zone in zones:
                skipped.append(node)
                continue
            zones.add(zone)
            chosen.append(node)
        else:  # every zone has its copy: fill up in walk order, skipped nodes first
            if skipped:
                chosen += skipped[: n - len(chosen)]
                skipped = []
            if len(chosen) < n:
                chosen.append(node)
        if len(chosen) >= n:
            return chosen[:n]
    chosen += skipped[: n - len(chosen)]
    return chosen


def local_first(nodes: Sequence[str], zone_of: Mapping[str, str], local: str) -> list[str]:
    """`nodes` with those in zone `local` first (otherwise in the given order)."""
    return sorted(nodes, key=lambda node: zone_of.get(node, DEFAULT_ZONE) != local)


def prefer_zone(loads: Mapping[str, float], zone_of: Mapping[str, str], local: str,
                slack: float) -> set[str] | None:
    """The members a router should choose among: those of zone `local`, unless it has none or its
    mean load exceeds ``(1 + slack) x`` the other zones' mean load plus one request (then None: all).

    `loads` maps each healthy candidate to its outstanding requests. The plus one keeps an idle
    remote zone from pulling traffic off a local zone that serves a single request."""
    mine = [m for m in loads if zone_of.get(m, DEFAULT_ZONE) == local]
    if not mine:
        return None
    others = [m for m in loads if zone_of.get(m, DEFAULT_ZONE) != local]
    if not others:
        return set(mine)
    if spills(sum(loads[m] for m in mine) / len(mine), sum(loads[m] for m in others) / len(others), slack):
        return None
    return set(mine)


def spills(local_load: float, remote_load: float, slack: float) -> bool:
    """Does a zone whose members carry `local_load` on average spill to the others (mean
    `remote_load`)? Past ``(1 + slack) x remote + 1``: the rule of :func:`prefer_zone`, which the
    router evaluates from running per-zone sums (data_plane/routing/router.py)."""
    return local_load > (1 + slack) * remote_load + 1
