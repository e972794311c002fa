"""Session-wide fixtures: one real fp32 torch shard, and a throwaway redis-server per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.procs import Service
from tests.support.redis import RedisServer, have_redis


@pytest.fixture(scope="session")
def fp32_shard():
    """One real torch shard (float32, so greedy output is batch-invariant) for the session."""
    svc = Service(["shard", "--dtype", "float32", "--max-num-seqs", "16", "--max-model-len", "2048"],
                  ready_timeout=180)
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of the module's own (empty at the start), or a skip saying how to get one."""
    if not have_redis():
        pytest.skip("redis-server is not on PATH (apt-get install -y redis-server)")
    with RedisServer() as server:
        yield server
