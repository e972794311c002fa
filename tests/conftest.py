from __future__ import annotations

import pytest

from tests.support.procs import Service


@pytest.fixture(scope="session")
def fp32_shard():
    """One real torch shard (float32, so greedy output is batch-invariant) for the session."""
    svc = Service(["shard", "--dtype", "float32", "--max-num-seqs", "16", "--max-model-len", "2048"],
                  ready_timeout=180)
    svc.start()
    yield svc
    svc.stop()
