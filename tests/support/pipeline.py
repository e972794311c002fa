"""A pipelined shard's stage processes and its exit, for tests (Linux: reads /proc).

    (stage,) = stage_pids(shard)                # a 2-stage shard's one stage child (pipeline_stage)
    os.kill(stage, signal.SIGKILL)
    assert exit_within(shard, 15) == 1          # the shard exits once a stage is gone

Used by tests/data_plane/test_pipeline.py and tests/observability/test_pipeline_live.py.
"""

from __future__ import annotations

import os

from tests.support.procs import Service


def stage_pids(shard: Service) -> list[int]:
    """The shard's stage processes (its children running pipeline_stage), from /proc."""
    assert shard.proc is not None
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == shard.proc.pid and b"pipeline_stage" in cmdline:
            pids.append(int(entry))
    return pids


def exit_within(shard: Service, seconds: float) -> int | None:
    """The shard process's exit code once it exits within `seconds`; None while it still runs."""
    assert shard.proc is not None
    try:
        return shard.proc.wait(seconds)
    except Exception:  # noqa: BLE001 - still running: the caller's assertion says so
        return None
