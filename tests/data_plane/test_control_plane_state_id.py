"""A gateway whose control plane comes back with another state, with real processes.

A control plane started by mistake with another state dir (on the port of the real one) silently reset
the degradation pin, the tier edits and the abuse actions: gateways adopted the reset within a second
and only logged "degradation level 2 -> 0: initial". The control plane's state dir has a persistent id
now (control_plane/state_api.py: ``state_id``), and a gateway that sees it change logs an ERROR and counts
it (``switchboard_gateway_control_plane_state_changes_total``); a restart on the same dir is no change.

    .venv/bin/python -m pytest tests/data_plane/test_control_plane_state_id.py -q       # ~15 s
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.cluster import ADMIN_TOKEN, api_keys_env, open_control_plane
from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.waits import eventually

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHANGES = "switchboard_gateway_control_plane_state_changes_total"


def level(gw: Service) -> int:
    return int(httpx.get(gw.url + "/health", timeout=5).json()["degradation_level"])


def pin(cp: Service, to: int) -> None:
    assert httpx.put(cp.url + "/admin/v1/degradation", headers=AUTH, timeout=5,
                     json={"level": to, "reason": "drill"}).status_code == 200


def test_a_control_plane_started_on_another_state_dir_is_reported_by_every_gateway(tmp_path: Path) -> None:
    first = tmp_path / "state"
    cp = open_control_plane("--warmup", "0", "--state-dir", str(first), log_path=tmp_path / "cp1.log").start()
    port = cp.port
    gw = Service(["gateway", "--shard-urls", "http://127.0.0.1:1", "--cache-urls", "http://127.0.0.1:1",
                  "--control-plane-url", cp.url, "--tokenizer", "whitespace", "--model-name", "synthetic"],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
    try:
        state_id = httpx.get(cp.url + "/v1/state", timeout=5).json()["state_id"]
        assert state_id and (first / "state_id.json").exists()
        pin(cp, 2)
        gw.start()
        eventually(lambda: level(gw) == 2, 10, what="the gateway at the pinned level")
        # a restart on the same state dir: the same state, nothing to report
        cp.kill()
        cp = open_control_plane("--warmup", "0", "--state-dir", str(first), port=port,
                                log_path=tmp_path / "cp2.log").start()
        assert httpx.get(cp.url + "/v1/state", timeout=5).json()["state_id"] == state_id
        pin(cp, 3)  # seen by the gateway: it follows the restarted process
        eventually(lambda: level(gw) == 3, 15, what="the gateway on the restarted control plane")
        assert metric(gw.url, CHANGES) == 0
        # by mistake, another state dir on the same port: the pin is gone, and the gateway says so
        cp.stop()
        cp = open_control_plane("--warmup", "0", "--state-dir", str(tmp_path / "other"), port=port,
                                log_path=tmp_path / "cp3.log").start()
        other = httpx.get(cp.url + "/v1/state", timeout=5).json()["state_id"]
        assert other and other != state_id
        eventually(lambda: metric(gw.url, CHANGES) == 1, 15, what="the state change counted",
                   detail=lambda: gw.log_tail(2000))
        assert level(gw) == 0  # adopted: the control plane is the authority
        log = gw.log_tail(20000)
        assert f"ERROR data_plane.gateway.cluster_state: the control plane at {cp.url}" in log, log
        assert f"another state (state id {other}, was {state_id})" in log
        # ... once: it follows the new state from then on
        cp.kill()
        cp = open_control_plane("--warmup", "0", "--state-dir", str(tmp_path / "other"), port=port,
                                log_path=tmp_path / "cp4.log").start()
        pin(cp, 1)
        eventually(lambda: level(gw) == 1, 15, what="the gateway on the restarted control plane")
        assert metric(gw.url, CHANGES) == 1
    finally:
        gw.stop()
        cp.stop()
