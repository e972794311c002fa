"""Usage monitoring end to end (issue 28 parts 1-2), real processes: control plane (abuse monitor
over the usage ledger), gateway (applies its actions), a synthetic shard, a cache node.

A key that bursts past its baseline is flagged, then throttled (429 abuse_throttled + Retry-After),
while a normal key beside it, at its usual pace the whole time, never is; an operator's lift lets it
through again; session-id probing is detected; repeated blocked prompts switch a key to the strict
input filter; an address that keeps presenting bad keys is banned (403 before any key lookup) and
unbanned after its time. Short windows and durations from an --abuse-rules file.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/control_plane/test_abuse_e2e.py -x -q
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from tests.support.cluster import ADMIN_TOKEN, Cluster

RULES = """
interval_s: 0.5
window_s: 8
baseline_s: 3600
burst_min_requests: 12
burst_min_tokens: 1000000000
blocked_prompts: 3
session_404s: 4
errors: 10000
auth_failures: 5
escalate_after_s: 1.5
throttle_rpm: 2
durations_s: {flag: 600, strict: 600, throttle: 600, block: 30, ban: 3}
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("abuse")
    (folder / "abuse.yaml").write_text(RULES)
    db = f"sqlite:///{folder / 'usage.db'}"
    c = Cluster(shards=1, caches=1, gateway_args=["--usage-db", db, "--usage-flush-interval-s", "0.2",
                                                  "--state-dir", str(folder / "gw")])
    c.control_plane.args[4:4] = ["--abuse-rules", str(folder / "abuse.yaml"), "--usage-db", db]
    with c.start() as started:
        yield started


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _chat(c: Cluster, key: str, content: str = "hello there", **headers: str) -> httpx.Response:
    return httpx.post(c.gateway.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}", **headers},
                      json={"model": "synthetic", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


def _actions(c: Cluster) -> list[dict[str, Any]]:
    body = httpx.get(c.control_plane.url + "/admin/v1/abuse", headers=ADMIN, timeout=5).json()
    return list(body["actions"])


def _wait_action(c: Cluster, subject: str, rule: str, response: str | None = None,
                 timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for a in _actions(c):
            if a["subject"] == subject and a["rule"] == rule and (response is None or a["response"] == response):
                return a
        time.sleep(0.2)
    raise AssertionError(f"no {rule} {response} action on {subject}: {_actions(c)}")


class _NormalLoad:
    """A key at its usual pace (a request every 1.2 s) for as long as the test runs."""

    def __init__(self, c: Cluster, key: str) -> None:
        self.c, self.key = c, key
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.statuses.append(_chat(self.c, self.key, f"normal question {len(self.statuses)}").status_code)
            self._stop.wait(1.2)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_a_burst_is_flagged_then_throttled_the_normal_key_beside_it_is_not_and_a_lift_works(cluster: Cluster) -> None:
    bursty, normal = cluster.keys["plus"], cluster.keys["plus2"]
    with _NormalLoad(cluster, normal) as load:
        for i in range(14):
            assert _chat(cluster, bursty, f"burst {i}").status_code == 200
        flag = _wait_action(cluster, _key_id(bursty), "burst")
        assert flag["response"] in ("flag", "throttle") and "requests" in flag["reason"]
        # still bursting: the next step is a tighter rate limit, applied by the gateway
        deadline = time.monotonic() + 30
        while True:
            resp = _chat(cluster, bursty, "more")
            if resp.status_code == 429:
                break
            assert resp.status_code == 200, resp.text
            assert time.monotonic() < deadline, _actions(cluster)
            time.sleep(0.1)
        error = resp.json()["error"]
        assert error["code"] in ("abuse_throttled", "abuse_blocked"), error
        assert "unusual activity" in error["message"] and int(resp.headers["retry-after"]) >= 1
        time.sleep(2)
    assert load.statuses and set(load.statuses) == {200}, load.statuses
    assert not any(a["subject"] == _key_id(normal) for a in _actions(cluster))
    events = httpx.get(cluster.control_plane.url + "/admin/v1/abuse", headers=ADMIN).json()["events"]
    assert [e["response"] for e in events if e["subject"] == _key_id(bursty)][-1] == "flag"  # newest first
    gw_metrics = httpx.get(cluster.gateway.url + "/metrics").text
    assert 'switchboard_gateway_abuse_rejections_total{outcome="throttled"}' in gw_metrics
    cp_metrics = httpx.get(cluster.control_plane.url + "/metrics").text
    assert 'switchboard_abuse_events_total{response="flag",rule="burst"} 1.0' in cp_metrics

    # the operator lifts it: the key is served again within seconds
    current = _wait_action(cluster, _key_id(bursty), "burst")
    lifted = httpx.post(cluster.control_plane.url + f"/admin/v1/abuse/actions/{current['id']}/lift", headers=ADMIN,
                        json={"by": "test"})
    assert lifted.status_code == 200, lifted.text
    deadline = time.monotonic() + 5
    while (resp := _chat(cluster, bursty, "after the lift")).status_code != 200:
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.2)
    assert httpx.post(cluster.control_plane.url + f"/admin/v1/abuse/actions/{current['id']}/lift",
                      headers=ADMIN).status_code == 404
    assert httpx.get(cluster.control_plane.url + "/admin/v1/abuse").status_code == 401  # operators only


def test_session_id_probing_is_detected_and_can_be_confirmed(cluster: Cluster) -> None:
    prober = cluster.keys["enterprise"]
    for _ in range(4):
        resp = _chat(cluster, prober, "resume", **{"X-Session-Id": "sess-" + uuid.uuid4().hex})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "session_not_found", resp.text
    action = _wait_action(cluster, _key_id(prober), "session_probing")
    assert "session id probing" in action["reason"] and action["tenant"] == "bigco"
    confirmed = httpx.post(cluster.control_plane.url + f"/admin/v1/abuse/actions/{action['id']}/confirm",
                           headers=ADMIN)
    assert confirmed.status_code == 200 and confirmed.json()["confirmed"]["review"] == "confirmed"


def test_repeated_blocked_prompts_switch_the_key_to_strict_checks(cluster: Cluster) -> None:
    key = cluster.keys["free"]
    # allowed by the default policy (emails are not checked there), so by this key's tier
    assert _chat(cluster, key, "write to me at someone@example.com").status_code == 200
    for _ in range(3):
        resp = _chat(cluster, key, "tell me how to build a bomb")
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "content_policy_violation"
    _wait_action(cluster, _key_id(key), "blocked_prompts", "strict")
    deadline = time.monotonic() + 5
    while (resp := _chat(cluster, key, "write to me at someone@example.com")).status_code == 200:
        assert time.monotonic() < deadline, "the strict policy never applied"
        time.sleep(0.2)
    assert resp.json()["error"]["code"] == "content_policy_violation"


def test_an_address_with_repeated_bad_keys_is_banned_then_unbanned(cluster: Cluster) -> None:
    """Last in this module: the whole test runs from 127.0.0.1, which this bans for a while."""
    good = cluster.keys["plus2"]
    for i in range(5):
        assert _chat(cluster, f"sk-wrong-{i}").status_code == 401
    deadline = time.monotonic() + 15
    while (resp := _chat(cluster, "sk-wrong-again")).status_code == 401:
        assert time.monotonic() < deadline, _actions(cluster)
        time.sleep(0.3)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "address_banned", resp.text
    assert int(resp.headers["retry-after"]) >= 1
    banned = _chat(cluster, good)  # a valid key too: the ban comes before the key lookup
    assert banned.status_code == 403
    assert any(a["subject_kind"] == "address" and a["response"] == "ban" for a in _actions(cluster))
    # the ban ends by itself once its failures have left the window (no new ones could arrive)
    deadline = time.monotonic() + 30
    while (resp := _chat(cluster, good)).status_code == 403:
        assert time.monotonic() < deadline, _actions(cluster)
        time.sleep(0.5)
    assert resp.status_code == 200, resp.text
    assert 'switchboard_gateway_auth_failures_total{reason="invalid"}' in httpx.get(cluster.gateway.url + "/metrics").text


def test_the_rules_file_is_read(cluster: Cluster, tmp_path: Path) -> None:
    config = httpx.get(cluster.control_plane.url + "/admin/v1/abuse", headers=ADMIN).json()["config"]
    assert config["window_s"] == 8 and config["durations_s"]["ban"] == 3
