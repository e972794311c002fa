"""The local actuator's host cap (``--local-max-shards``): it starts what the host holds, says so,
and the autoscaler records the scale-out as ``capped`` once (folded), never as calm or as a crash.

    .venv/bin/python -m pytest tests/control_plane/test_actuator_cap.py -q      # ~10 s (real shard processes)

A shard beyond the host's cores slows every shard instead of adding capacity (measured on 2 cores:
three one-thread torch shards gave enterprise 3.1x its unloaded TTFT p95 at 2x load, docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from control_plane.scaling.actuators import ActuatorCapped
from control_plane.scaling.actuators.local import LocalActuator
from control_plane.scaling.loop import Autoscaler, AutoscalerMetrics
from control_plane.scaling.policy import PolicyConfig, TargetTracking
from control_plane.scaling.simulate import fleet_signals
from control_plane.signals.model import Signals
from tests.support.procs import CLUSTER_TOKEN, Service

SLOTS = 4


class _HotSource:
    """Signals of a fleet with 10 requests waiting per shard (a queue: the policy scales out)."""

    def __init__(self, ready: int) -> None:
        self.ready = ready

    async def read(self) -> Signals:
        return fleet_signals(at=time.time(), ready=self.ready, running=self.ready * SLOTS,
                             waiting=self.ready * 10.0, slots=SLOTS, ttft_p95_s=0.2, window_s=30.0)


async def test_the_host_cap_starts_what_fits_and_the_autoscaler_records_it_as_capped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_CLUSTER_TOKEN", CLUSTER_TOKEN)
    with Service(["control-plane", "--admin-token", "cap-test-token"]) as cp:
        async with httpx.AsyncClient() as http:
            actuator = LocalActuator(cp.url, http, admin_token="cap-test-token", log_dir=tmp_path,
                                     shard_args=["--engine", "synthetic"], max_shards=2)
            try:
                with pytest.raises(ActuatorCapped, match="holds 2 shards"):
                    await actuator.scale_to(3, "test: past the cap")
                assert await actuator.current() == 2  # what fits was started

                registry = CollectorRegistry()
                config = PolicyConfig(min_replicas=1, max_replicas=6, target_waiting_per_shard=2.0,
                                      ttft_slo_s=1.0, scale_up_cooldown_s=0.0, scale_down_cooldown_s=60.0)
                scaler = Autoscaler(TargetTracking(config), _HotSource(2), actuator,
                                    metrics=AutoscalerMetrics(registry))
                for _ in range(3):
                    d = await scaler.tick()
                    await asyncio.sleep(0)
                assert d["action"] == "scale_up" and d["from"] == 2 and d["to"] > 2
                assert d["outcome"].startswith("capped: this host holds 2 shards")
                log = scaler.decisions()
                assert len(log) == 1 and log[0]["repeats"] == 3  # one entry, not one per tick
                assert await actuator.current() == 2  # nothing started past the cap
                assert registry.get_sample_value("switchboard_autoscaler_desired_replicas",
                                                 {"service": "shard"}) == d["to"]
            finally:
                await actuator.aclose()
