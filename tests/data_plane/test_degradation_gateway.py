"""The degradation ladder and hot tier policy as a user of a running gateway sees them.

    .venv/bin/python -m pytest tests/data_plane/test_degradation_gateway.py -q

Real processes on loopback: a control plane with a state dir, one synthetic shard, one gateway
that watches the control plane's ``/v1/state``. The operator steers through the admin API only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from data_plane.tiers import TierPolicy
from tests.support.cluster import ADMIN_TOKEN, KEYS, api_keys_env
from tests.support.metrics import metric_in, scrape
from tests.support.procs import CLUSTER_HEADERS, Service
from tests.support.waits import eventually

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROPAGATION_S = 2.0


class Stack:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.control_plane = self._control_plane()
        registry = self.control_plane.url
        self.shard = Service(["shard", "--engine", "synthetic", "--registry-url", registry, "--node-id", "shard-0",
                              "--synthetic-token-delay-ms", "1"])
        self.gateway = Service(["gateway", "--registry-url", registry, "--tokenizer", "whitespace",
                                "--model-name", "synthetic"], env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        self.admin = httpx.Client(base_url=registry, headers=ADMIN, timeout=10.0)

    def _control_plane(self, port: int | None = None) -> Service:
        return Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0",
                        "--state-dir", str(self.state_dir)], port=port)

    def start(self) -> Stack:
        self.control_plane.start()
        self.shard.start()
        self.gateway.start()
        eventually(lambda: self.health()["shards"] == 1, 15.0)
        return self

    def restart_control_plane(self) -> None:
        self.control_plane = self._control_plane(self.control_plane.port)
        self.control_plane.start()

    def stop(self) -> None:
        self.admin.close()
        for svc in (self.gateway, self.shard, self.control_plane):
            svc.stop()

    def health(self) -> dict[str, Any]:
        return httpx.get(self.gateway.url + "/health", timeout=2.0).json()

    def chat(self, tier: str, content: str = "hello there", **body: Any) -> httpx.Response:
        messages = body.pop("messages", None) or [{"role": "user", "content": content}]
        body.setdefault("max_tokens", 16)  # the tiers' default caps fill the synthetic 2048-token context
        body = {k: v for k, v in body.items() if v is not None}
        return httpx.post(self.gateway.url + "/v1/chat/completions", json={"messages": messages, **body},
                          headers={"Authorization": f"Bearer {KEYS[tier]}"}, timeout=10.0)

    def pin(self, level: int) -> float:
        """Pin `level` through the admin API; returns how long the gateway took to apply it."""
        resp = self.admin.put("/admin/v1/degradation", json={"level": level, "reason": f"test level {level}"})
        assert resp.status_code == 200, resp.text
        return eventually(lambda: self.health()["degradation_level"] == level, PROPAGATION_S)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("state"))
    try:
        s.start()
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


def assert_shed(resp: httpx.Response, level: int) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "overloaded" and resp.json()["error"]["type"] == "server_error"
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["x-switchboard-degraded"] == str(level)
    # the x-ratelimit-* headers every response carries, read without taking quota (the ladder sheds first)
    assert {f"x-ratelimit-{w}-{k}" for w in ("limit", "remaining", "reset") for k in ("requests", "tokens")} \
        <= set(resp.headers), dict(resp.headers)


def test_normal_service_has_no_degraded_header(stack: Stack) -> None:
    health = stack.health()
    assert health["degradation_level"] == 0 and health["control_plane_reachable"] is True
    for tier in ("free", "plus", "enterprise"):
        resp = stack.chat(tier)
        assert resp.status_code == 200, resp.text
        assert "x-switchboard-degraded" not in resp.headers


def test_level_3_sheds_free_and_level_4_keeps_only_enterprise(stack: Stack) -> None:
    stack.pin(3)  # fails unless the gateways see it within PROPAGATION_S
    assert_shed(stack.chat("free"), 3)
    for tier in ("plus", "enterprise"):
        resp = stack.chat(tier)
        assert resp.status_code == 200 and resp.headers["x-switchboard-degraded"] == "3"
    with httpx.stream("POST", stack.gateway.url + "/v1/chat/completions", timeout=10.0,
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                      headers={"Authorization": f"Bearer {KEYS['enterprise']}"}) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-switchboard-degraded"] == "3"
        assert "[DONE]" in streamed.read().decode()

    stack.pin(4)
    assert_shed(stack.chat("free"), 4)
    before = stack.chat("free").headers["x-ratelimit-remaining-requests"]
    for _ in range(3):
        assert_shed(shed := stack.chat("free"), 4)
    assert int(shed.headers["x-ratelimit-remaining-requests"]) >= int(before)  # sheds cost no quota
    assert_shed(stack.chat("plus"), 4)
    resp = stack.chat("enterprise")
    assert resp.status_code == 200 and resp.headers["x-switchboard-degraded"] == "4"

    spans = httpx.get(stack.gateway.url + "/debug/spans", headers=CLUSTER_HEADERS).json()
    levels = [s["attributes"].get("switchboard.degradation_level") for s in spans if s["name"] == "gateway.request"]
    assert levels[-1] == 4 and 0 in levels


def test_level_1_shrinks_the_context_and_level_2_caps_output(stack: Stack) -> None:
    long_history = [{"role": "user", "content": "word " * 1200}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "and now?"}]
    stack.pin(0)
    full = stack.chat("free", messages=long_history, max_tokens=16)
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["prompt_tokens"] > 1200
    stack.pin(1)
    shrunk = stack.chat("free", messages=long_history, max_tokens=16)
    assert shrunk.status_code == 200 and shrunk.headers["x-switchboard-degraded"] == "1"
    assert shrunk.json()["usage"]["prompt_tokens"] < 20  # the 1200-word turn no longer fits in 1024

    # a newest message that needs more than the shrunk half but fits the context is served, not a 400
    # (found under load: the ladder rose to 1 and every ~1700-token prompt got context_length_exceeded)
    alone = stack.chat("plus", content="word " * 1200, max_tokens=8)
    assert alone.status_code == 200, alone.text
    assert alone.json()["usage"]["prompt_tokens"] > 1200 and alone.headers["x-switchboard-degraded"] == "1"
    over = stack.chat("plus", content="word " * 2100, max_tokens=8)  # over the real context: still a 400
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert "only 1024 fit" not in over.json()["error"]["message"]  # names the real budget, not the shrunk one

    # above the level-2 cap (256) but within the tier's own (2048): capped, not refused
    assert stack.chat("enterprise", max_tokens=1000).status_code == 200
    stack.pin(2)
    capped = stack.chat("enterprise", max_tokens=1000)
    assert capped.status_code == 200 and capped.headers["x-switchboard-degraded"] == "2"
    stack.pin(0)


def test_tier_policy_is_hot_reloaded(stack: Stack) -> None:
    policy = TierPolicy.default().to_dict()
    policy["tiers"]["plus"]["max_output_tokens"] = 4
    resp = stack.admin.put("/admin/v1/tiers", json=policy)
    assert resp.status_code == 200, resp.text

    def capped() -> bool:
        r = stack.chat("plus", max_tokens=8)
        return r.status_code == 400 and "cap of 4" in r.json()["error"]["message"]

    eventually(capped, PROPAGATION_S)
    default = stack.chat("plus", max_tokens=None).json()  # the tier's cap is the default
    assert default["usage"]["completion_tokens"] == 4 and default["choices"][0]["finish_reason"] == "length"
    bad = stack.admin.put("/admin/v1/tiers", json={"tiers": {"plus": {"priority": 1}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tiers"
    assert stack.chat("plus", max_tokens=8).status_code == 400  # the valid policy stays in force


def test_an_operators_rate_limit_change_is_in_the_next_response_and_in_the_gateways_metrics(stack: Stack) -> None:
    """The limits a gateway enforced were nowhere in its /metrics: an operator could not see that a PUT had
    reached it (or that a gateway refused the new policy and kept the old one)."""
    before = {"tiers": stack.admin.get("/admin/v1/tiers").json()["tiers"]}

    def limit(tier: str, kind: str) -> float:
        return metric_in(scrape(stack.gateway.url), "switchboard_ratelimit_limit", tier=tier, kind=kind, scope="key")

    assert limit("plus", "requests") == before["tiers"]["plus"]["rpm"]
    assert limit("free", "tokens") == before["tiers"]["free"]["tpm"]
    policy = {"tiers": {name: dict(t) for name, t in before["tiers"].items()}}
    policy["tiers"]["plus"].update(rpm=7, tpm=7_000)
    del policy["tiers"]["free"]
    assert stack.admin.put("/admin/v1/tiers", json=policy).status_code == 200
    eventually(lambda: limit("plus", "requests") == 7, PROPAGATION_S)
    assert limit("plus", "tokens") == 7_000 and limit("free", "requests") == 0  # a deleted tier leaves
    r = stack.chat("plus", max_tokens=1)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "7", r.headers
    assert stack.admin.put("/admin/v1/tiers", json=before).status_code == 200
    eventually(lambda: limit("plus", "requests") == before["tiers"]["plus"]["rpm"], PROPAGATION_S)


def test_a_tier_deleted_from_the_hot_policy_refuses_its_keys_everywhere(stack: Stack) -> None:
    """Deleting a tier from the control plane's policy used to leave its keys served at the tier the
    gateway started with; now they get 403 tier_removed on every route (chat, models, stored records),
    the other tiers are untouched, and restoring the tier serves them again."""
    before = {"tiers": stack.admin.get("/admin/v1/tiers").json()["tiers"]}  # the earlier tests' policy
    policy = {"tiers": {name: tier for name, tier in before["tiers"].items() if name != "plus"}}
    assert stack.admin.put("/admin/v1/tiers", json=policy).status_code == 200

    def refused() -> bool:
        return stack.chat("plus").status_code == 403

    eventually(refused, PROPAGATION_S)
    plus = {"Authorization": f"Bearer {KEYS['plus']}"}
    for resp in (stack.chat("plus"), stack.chat("plus", stream=True),
                 httpx.get(stack.gateway.url + "/v1/models", headers=plus, timeout=5.0),
                 httpx.get(stack.gateway.url + "/v1/chat/completions", headers=plus, timeout=5.0),
                 httpx.get(stack.gateway.url + "/v1/responses/resp_nope", headers=plus, timeout=5.0)):
        assert resp.status_code == 403, (resp.request.url, resp.text)
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("permission_error", "tier_removed"), error
        assert "'plus'" in error["message"] and KEYS["plus"] not in error["message"]
    for tier in ("free", "enterprise"):
        assert stack.chat(tier).status_code == 200
    text = scrape(stack.gateway.url)
    assert 'switchboard_gateway_tier_refusals_total{tier="plus"}' in text
    assert 'code="tier_removed"' in text and 'status="403"' in text
    log = stack.gateway.log_tail(200_000)
    assert "its tier 'plus' is not in the tier policy in force" in log and KEYS["plus"] not in log

    assert stack.admin.put("/admin/v1/tiers", json=before).status_code == 200
    eventually(lambda: stack.chat("plus", max_tokens=1).status_code == 200, PROPAGATION_S)


def test_gateway_keeps_the_last_state_without_the_control_plane(stack: Stack) -> None:
    stack.pin(3)
    stack.control_plane.kill()
    eventually(lambda: stack.health()["control_plane_reachable"] is False, 5.0)
    assert stack.health()["degradation_level"] == 3
    assert_shed(stack.chat("free"), 3)
    ent = stack.chat("enterprise")
    assert ent.status_code == 200 and ent.headers["x-switchboard-degraded"] == "3"
    assert stack.chat("plus", max_tokens=8).status_code == 400  # the hot policy too

    stack.restart_control_plane()  # same port, same state dir
    got = stack.admin.get("/admin/v1/degradation").json()
    assert (got["level"], got["pinned"]) == (3, True)
    assert stack.admin.get("/admin/v1/tiers").json()["tiers"]["plus"]["max_output_tokens"] == 4
    eventually(lambda: stack.health()["control_plane_reachable"] is True, 5.0)
    assert_shed(stack.chat("free"), 3)

    stack.pin(0)
    assert stack.admin.delete("/admin/v1/degradation").json()["pinned"] is False
    assert stack.admin.put("/admin/v1/tiers", json=TierPolicy.default().to_dict()).status_code == 200
    eventually(lambda: stack.chat("plus", max_tokens=8).status_code == 200, PROPAGATION_S)
    resp = stack.chat("free")
    assert resp.status_code == 200 and "x-switchboard-degraded" not in resp.headers


def test_admin_traces_show_a_request_across_processes(stack: Stack) -> None:
    resp = stack.chat("enterprise", content="trace me")
    assert resp.status_code == 200
    trace_id = resp.headers.get("x-trace-id")

    def found() -> bool:
        traces = stack.admin.get("/admin/v1/traces", params={"tier": "enterprise", "limit": 5}).json()["traces"]
        return any(
            t["root"] == "gateway.request" and {"switchboard-gateway", "switchboard-shard"} <= set(t["services"])
            and (trace_id is None or t["trace_id"] == trace_id)
            for t in traces
        )

    eventually(found, 5.0, 0.2)


# -- the rules themselves, without processes ---------------------------------------------------


def test_effects_by_level() -> None:
    from data_plane.common.errors import Overloaded
    from data_plane.gateway.cluster_state import Degradation, Effects

    policy = TierPolicy.default()
    for level in range(5):
        fx = Effects(Degradation(level=level, retry_after_s=7))
        assert fx.max_tokens(1000) == (256 if level >= 2 else 1000)
        assert fx.max_tokens(100) == 100
        assert fx.prompt_budget(2032, 2048) == (1024 if level >= 1 else 2032)
        assert fx.prompt_budget(500, 2048) == 500  # never more than it had
        shed = set()
        for name in policy.names():
            try:
                fx.admit(policy[name], policy)
            except Overloaded as exc:
                assert exc.retry_after == 7 and exc.status == 503
                shed.add(name)
        assert shed == [set(), set(), set(), {"free"}, {"free", "plus"}][level]
    # one tier only: nothing below it in the shed order, so nothing is shed
    solo = TierPolicy.from_dict({"tiers": {"solo": policy.to_dict()["tiers"]["free"]}})
    Effects(Degradation(level=4)).admit(solo["solo"], solo)


async def test_watcher_refuses_a_policy_the_gateway_cannot_serve() -> None:
    from data_plane.gateway.cluster_state import HttpClusterState

    strict = TierPolicy.default().to_dict()
    strict["tiers"]["plus"]["safety"] = "no-such-policy"
    bodies = [{"index": 2, "degradation": {"level": 2, "reason": "r", "pinned": False, "since": 1.0},
               "tiers": TierPolicy.default().to_dict()},
              {"index": 3, "degradation": {"level": 3, "reason": "r", "pinned": True, "since": 2.0},
               "tiers": strict}]

    def handler(request: httpx.Request) -> httpx.Response:  # a fake at the transport boundary
        return httpx.Response(200, json=bodies.pop(0)) if bodies else httpx.Response(503)

    def validate(policy: TierPolicy) -> None:
        if any(policy[n].safety != "default" for n in policy):
            raise ValueError("unknown safety policy")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        watcher = HttpClusterState("http://cp", http, validate=validate)
        await watcher._sync(wait_s=0, timeout_s=1)
        assert watcher.current().degradation.level == 2 and watcher.current().tiers == TierPolicy.default()
        await watcher._sync(wait_s=0, timeout_s=1)
        # the level applies; the unservable policy does not, the previous one stays
        assert watcher.current().degradation.level == 3 and watcher.current().tiers == TierPolicy.default()
        assert not await watcher._sync(wait_s=0, timeout_s=1)  # 503: unreachable, last state kept
        assert not watcher.reachable and watcher.current().degradation.level == 3


def test_tier_gate_refuses_a_missing_tier_and_logs_its_key_id_once_a_minute(caplog) -> None:
    from prometheus_client import CollectorRegistry

    from data_plane.common.errors import PermissionDenied
    from data_plane.gateway.auth import Principal
    from data_plane.gateway.tier_gate import TierGate

    now = [0.0]
    registry = CollectorRegistry()
    gate = TierGate(registry, clock=lambda: now[0])
    policy = TierPolicy.default()
    assert gate.tier(Principal("abc123", "acme", "plus"), policy).name == "plus"
    gone = Principal("def456", "acme", "gold")
    with caplog.at_level("WARNING", logger="data_plane.gateway.tier_gate"):
        for t in (0.0, 30.0, 61.0):
            now[0] = t
            with pytest.raises(PermissionDenied) as refused:
                gate.tier(gone, policy)
            assert (refused.value.status, refused.value.code) == (403, "tier_removed")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["refusing API key def456"] * 2
    assert registry.get_sample_value("switchboard_gateway_tier_refusals_total", {"tier": "gold"}) == 3
