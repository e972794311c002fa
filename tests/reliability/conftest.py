"""Shared processes for the reliability suite (bad input and security share one cluster).

Tests that kill, overload or partition processes build their own; the ones here stay healthy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.procs import Service

# The bad-input and security suites present invalid keys, unknown sessions and blocked prompts on
# purpose, all from 127.0.0.1: under the abuse monitor's defaults that address would be banned
# (10 failed authentications) and every later test in the package refused with 403. The monitor's
# own behaviour is tested in tests/control_plane/test_abuse_e2e.py; here its thresholds sit above
# anything these suites send.
QUIET_ABUSE_RULES = """
auth_failures: 100000
session_404s: 100000
blocked_prompts: 100000
errors: 100000
burst_min_requests: 100000000
burst_min_tokens: 1000000000000
tenant_burst_min_requests: 100000000
tenant_burst_min_tokens: 1000000000000
tenant_session_404s: 100000
"""


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Control plane, 2 cache nodes, 2 synthetic shards, a gateway: used read-only-ish (no kills)."""
    rules = tmp_path_factory.mktemp("abuse") / "abuse.yaml"
    rules.write_text(QUIET_ABUSE_RULES)
    c = Cluster(shards=2, caches=2, token_delay_ms=1)
    c.control_plane.args += ["--abuse-rules", str(rules)]
    with c as started:
        yield started


@pytest.fixture(scope="package")
def lone_control_plane() -> Iterator[Service]:
    """A control plane with no members, for tests that steer it (fuzzing its admin API pins levels
    and replaces the tier policy, which must not disturb the shared cluster)."""
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0"]) as cp:
        yield cp
