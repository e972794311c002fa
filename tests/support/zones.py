"""Zoned clusters for tests: a synthetic-model gateway per zone, started once the zones' members are up.

    gws = {z: zone_gateway(cp.url, z) for z in ("a", "b")}
    started: list[Service] = []
    start_zones([cp, *members], gws, started)   # members healthy, then gateways that see every member
    ...; for svc in reversed(started): svc.stop()

Used by tests/data_plane/test_responses_zones.py and tests/reliability/test_zone_outage.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.support.cluster import api_keys_env
from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.waits import eventually


def zone_gateway(registry_url: str, zone: str) -> Service:
    """Zone `zone`'s gateway (`gateway-<zone>`, synthetic model, whitespace tokenizer, the test keys); not started."""
    return Service(["gateway", "--registry-url", registry_url, "--tokenizer", "whitespace", "--model-name",
                    "synthetic", "--zone", zone, "--node-id", f"gateway-{zone}"],
                   env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})


def start_zones(members: Sequence[Service], gateways: dict[str, Service], started: list[Service], *,
                shards: int = 2, caches: int = 2, timeout: float = 20.0) -> None:
    """Start `members` at once and wait until each is healthy, then the gateways, then wait until every
    gateway's membership holds `shards` shards and `caches` cache nodes. Each process started is appended
    to `started` (the caller stops them, last first, whatever happens)."""
    for svc in members:
        svc.start(wait=False)
        started.append(svc)
    for svc in members:
        svc.wait_healthy()
    for gw in gateways.values():
        gw.start()
        started.append(gw)
    for gw in gateways.values():
        eventually(lambda: metric(gw.url, "switchboard_gateway_members", service="shard") == shards  # noqa: B023
                   and metric(gw.url, "switchboard_gateway_members", service="cache") == caches,  # noqa: B023
                   timeout, what=f"every zone's members in {gw.url}'s membership")
