"""Shared processes for the reliability suite (bad input and security share one cluster).

Tests that kill, overload or partition processes build their own; the ones here stay healthy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.procs import Service


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    """Control plane, 2 cache nodes, 2 synthetic shards, a gateway: used read-only-ish (no kills)."""
    with Cluster(shards=2, caches=2, token_delay_ms=1) as c:
        yield c


@pytest.fixture(scope="package")
def lone_control_plane() -> Iterator[Service]:
    """A control plane with no members, for tests that steer it (fuzzing its admin API pins levels
    and replaces the tier policy, which must not disturb the shared cluster)."""
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0"]) as cp:
        yield cp
