"""Session-wide fixtures: one real fp32 torch shard, and a throwaway redis-server per module."""

from __future__ import annotations

import os
from collections.abc import Iterator

from data_plane.common.cores import SPIN_COUNT

# As `switchboard` sets it for its processes (data_plane/common/cores.py), before a test loads torch and
# libgomp with it: the in-process engines of the test workers spun ~6 ms at each region's end, on cores
# that the other worker and the shards needed (a quality test that takes 3 s alone took 384 s in a loaded CI).
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

import pytest

from tests.support.formats import INVARIANT_ARGS
from tests.support.procs import Service
from tests.support.redis import RedisServer, have_redis


@pytest.fixture(scope="session")
def fp32_shard():
    """One real torch shard for the session, in the batch-invariant format (tests/support/formats.py: float32
    activations on blockq's int4 kernel), so greedy output does not depend on the batch, nor on the CPU.

    It was float32 dense: 513 MiB of weights read a token, a 60 ms decode step, and ~220 CPU-seconds of a
    `make test` (the two workers' shards, a Zen 4); its answers also depended on the CPU's sgemm path."""
    svc = Service(["shard", *INVARIANT_ARGS, "--max-num-seqs", "16", "--max-model-len", "2048"],
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
