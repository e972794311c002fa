"""The admin API and /v1/state on a real control-plane process (loopback), with a state dir.

    .venv/bin/python -m pytest tests/control_plane/test_admin_api.py -q

The only fake is `StubServer`, standing in for Alertmanager and for a member's ``/debug/spans``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.admin.traces import assemble_traces
from data_plane.tiers import TierPolicy
from tests.support.chat import assert_openai_error
from tests.support.cluster import ADMIN_TOKEN, open_control_plane
from tests.support.disk import small_disk
from tests.support.metrics import metric_in
from tests.support.procs import Service
from tests.support.waits import eventually_async

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TRACE = "ab" * 16


def span(span_id: str, parent: str | None, name: str, service: str, start_ms: float, end_ms: float,
         status: str = "UNSET", trace_id: str = TRACE, **attributes: Any) -> dict[str, Any]:
    return {"trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "name": name,
            "service": service, "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6),
            "status": status, "attributes": attributes, "events": []}


STUB_SPANS = [
    span("1" * 16, None, "gateway.request", "switchboard-gateway", 1000, 1250, **{"switchboard.tier": "plus"}),
    span("2" * 16, "1" * 16, "router.route", "switchboard-gateway", 1010, 1240),
    span("3" * 16, "2" * 16, "shard.generate", "switchboard-shard", 1020, 1230),
]
STUB_ALERTS = [{"labels": {"alertname": "SwitchboardTTFTHigh", "severity": "warning"},
                "annotations": {"summary": "TTFT p95 above the SLO"},
                "startsAt": "2024-05-01T12:00:00.123456789Z", "status": {"state": "active"}}]


class StubServer:
    """A stub HTTP server: Alertmanager's ``/api/v2/alerts`` and a member's ``/debug/spans``."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                body = {"/api/v2/alerts": STUB_ALERTS, "/debug/spans": STUB_SPANS}.get(path)
                data = json.dumps(body).encode()
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    server = StubServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory, state_dir: Path,
                  stub: StubServer) -> Iterator[Service]:
    log_path = tmp_path_factory.mktemp("cp") / "control-plane.log"
    proc = open_control_plane("--warmup", "0", "--state-dir", str(state_dir), "--degradation-interval", "0.2",
                              log_path=log_path).start()
    yield proc
    proc.stop()


@pytest.fixture
def admin_url(control_plane: Service) -> Iterator[str]:
    """The shared control plane's URL; its ladder and tiers are reset after each test."""
    yield control_plane.url
    with httpx.Client(base_url=control_plane.url, headers=AUTH) as http:
        http.put("/admin/v1/degradation", json={"level": 0, "reason": "test cleanup"})
        http.delete("/admin/v1/degradation")
        http.put("/admin/v1/tiers", json=TierPolicy.default().to_dict())


def admin_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10.0)


ENDPOINTS = [
    ("GET", "/admin/v1/members"), ("GET", "/admin/v1/signals"), ("GET", "/admin/v1/decisions"),
    ("GET", "/admin/v1/degradation"), ("PUT", "/admin/v1/degradation"), ("DELETE", "/admin/v1/degradation"),
    ("GET", "/admin/v1/tiers"), ("PUT", "/admin/v1/tiers"), ("GET", "/admin/v1/traces"),
    ("GET", "/admin/v1/alerts"), ("POST", "/admin/v1/members/x/drain"), ("POST", "/admin/v1/members/x/undrain"),
]


async def test_every_admin_endpoint_needs_the_token(control_plane: Service) -> None:
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        for method, path in ENDPOINTS:
            body = {"level": 4, "reason": "x"} if path.endswith("degradation") and method == "PUT" else None
            for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": ADMIN_TOKEN}):
                resp = await http.request(method, path, json=body, headers=headers)
                err = assert_openai_error(resp, 401)
                assert err["type"] == "authentication_error", (method, path)
                assert resp.headers["WWW-Authenticate"] == "Bearer"
        state = (await http.get("/admin/v1/degradation", headers=AUTH)).json()
        assert state["level"] == 0  # none of the refused PUTs went through


async def test_pin_wakes_state_watchers_and_release_keeps_the_level(admin_url: str) -> None:
    async with admin_client(admin_url) as admin:
        first = (await admin.get("/v1/state")).json()
        assert first["degradation"]["level"] == 0
        # a 30 s blocking query: woken well inside it means woken by the change (a 2 s bound on a 10 s wait
        # failed on a loaded machine)
        watch = asyncio.create_task(admin.get("/v1/state", params={"index": first["index"], "wait": 30},
                                              timeout=60))
        await asyncio.sleep(0.2)
        assert not watch.done()  # a blocking query waits for a change
        resp = await admin.put("/admin/v1/degradation", json={"level": 3, "reason": "drill"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["level"] == 3 and resp.json()["pinned"] and resp.json()["name"] == "shed_free_tier"
        woke = (await asyncio.wait_for(watch, 10.0)).json()
        assert woke["index"] > first["index"] and woke["degradation"]["level"] == 3
        assert woke["degradation"]["pinned"] and woke["degradation"]["reason"] == "pinned: drill"

        got = (await admin.get("/admin/v1/degradation")).json()
        # the shed requests' Retry-After is the calm this level needs to step down (a pin: the gauge dwell,
        # 10 s), not the fixed windowed-figure dwell (30 s) it was for every cause
        assert woke["degradation"]["retry_after_s"] == got["automatic"]["lower_dwell_s"] == 10
        last = got["history"][-1]
        assert (last["from"], last["to"], last["actor"], last["reason"]) == (0, 3, "operator", "pinned: drill")
        assert got["automatic"]["verdict"] == "incomplete"  # no shards: the rule holds
        text = (await admin.get("/metrics")).text
        assert metric_in(text, "switchboard_degradation_level") == 3
        assert metric_in(text, "switchboard_degradation_pinned") == 1
        assert metric_in(text, "switchboard_degradation_changes_total", direction="up", actor="operator") >= 1

        released = (await admin.delete("/admin/v1/degradation", params={"reason": "drill over"})).json()
        assert released["level"] == 3 and not released["pinned"]
        assert released["history"][-1]["reason"] == "released: drill over"
        state = (await admin.get("/v1/state")).json()
        assert state["degradation"] == {**state["degradation"], "level": 3, "pinned": False}


async def test_a_route_errors_own_404_carries_the_request_and_trace_ids(admin_url: str) -> None:
    """Every error names its request (body and headers); an unknown member's drain did not (QA)."""
    async with admin_client(admin_url) as admin:
        resp = await admin.post("/admin/v1/members/nope/drain")
        err = assert_openai_error(resp, 404)
        assert len(err["request_id"]) == 32 and len(err["trace_id"]) == 32, err
        assert resp.headers["x-request-id"] == err["request_id"]


async def test_pin_validation(admin_url: str) -> None:
    async with admin_client(admin_url) as admin:
        for body in ({"level": 5, "reason": "x"}, {"level": 2}, {"level": 1, "reason": ""}, {"level": "high"},
                     {"level": 1, "reason": "x", "extra": 1}, {"level": "3", "reason": "x"},
                     {"level": 2.0, "reason": "x"}, {"level": True, "reason": "x"}):
            err = assert_openai_error(await admin.put("/admin/v1/degradation", json=body), 400)
            assert err["type"] == "invalid_request_error"
        assert (await admin.get("/admin/v1/degradation")).json()["level"] == 0


async def test_put_tiers_validates_persists_and_reaches_the_state(admin_url: str, state_dir: Path) -> None:
    async with admin_client(admin_url) as admin:
        before = (await admin.get("/admin/v1/tiers")).json()
        assert set(before["tiers"]) == {"free", "plus", "enterprise"}
        policy = TierPolicy.default().to_dict()
        policy["tiers"]["plus"]["max_output_tokens"] = 8
        resp = await admin.put("/admin/v1/tiers", json=policy)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["tiers"]["plus"]["max_output_tokens"] == 8 and body["source"] == "admin"
        assert body["state_index"] > before["state_index"]
        state = (await admin.get("/v1/state")).json()
        assert state["tiers"]["tiers"]["plus"]["max_output_tokens"] == 8 and state["index"] == body["state_index"]
        assert state["tiers_source"] == "admin"
        assert json.loads((state_dir / "tiers.json").read_text())["tiers"]["plus"]["max_output_tokens"] == 8

        bad_rpm = TierPolicy.default().to_dict()
        bad_rpm["tiers"]["free"]["rpm"] = 0
        unknown_field = TierPolicy.default().to_dict()
        unknown_field["tiers"]["free"]["burst"] = 3
        for bad, needle in ((bad_rpm, "tiers.free.rpm"), (unknown_field, "burst"), ({"tiers": {}}, "tiers"),
                            ({"free": {}}, "tiers")):
            err = assert_openai_error(await admin.put("/admin/v1/tiers", json=bad), 400)
            assert err["code"] == "invalid_tier_policy" and err["param"] == "tiers"
            assert needle in err["message"]
        assert_openai_error(await admin.put("/admin/v1/tiers", json=[1, 2]), 400)
        assert_openai_error(await admin.put("/admin/v1/tiers", content=b"{nope",
                                            headers={"content-type": "application/json"}), 400)
        after = (await admin.get("/admin/v1/tiers")).json()
        assert after["tiers"]["plus"]["max_output_tokens"] == 8 and after["state_index"] == body["state_index"]


async def test_put_tiers_refuses_what_every_gateway_would_refuse(admin_url: str) -> None:
    """QA: `safety: "10"` (no such policy on any gateway) and `rpm: 10**400` were a 200, then each gateway
    logged a refusal and kept the old policy (or served a 429 "needs 10**400 tokens"): the operator saw success."""
    async with admin_client(admin_url) as admin:
        resp = await admin.put("/v1/registry/members/gateway-safety", json={
            "service": "gateway", "url": "http://127.0.0.1:9", "ttl_s": 30,
            "meta": {"zone": "default", "safety_policies": "default,none"}})
        assert resp.status_code == 200, resp.text
        try:
            unknown = TierPolicy.default().to_dict()
            unknown["tiers"]["free"]["safety"] = "10"
            err = assert_openai_error(await admin.put("/admin/v1/tiers", json=unknown), 400)
            assert err["code"] == "invalid_tier_policy" and "'10'" in err["message"]
            assert "gateway-safety" in err["message"], err
            served = TierPolicy.default().to_dict()
            served["tiers"]["free"]["safety"] = "none"
            assert (await admin.put("/admin/v1/tiers", json=served)).status_code == 200
            huge = TierPolicy.default().to_dict()
            huge["tiers"]["free"]["rpm"] = 10**400
            err = assert_openai_error(await admin.put("/admin/v1/tiers", json=huge), 400)
            assert "tiers.free.rpm" in err["message"] and len(err["message"]) < 300
        finally:
            await admin.delete("/v1/registry/members/gateway-safety")
            await admin.put("/admin/v1/tiers", json=TierPolicy.default().to_dict())


async def test_signals_decisions_and_builtin_alerts(admin_url: str) -> None:
    async with admin_client(admin_url) as admin:
        async def has_signals() -> bool:
            return (await admin.get("/admin/v1/signals")).json()["latest"] is not None

        await eventually_async(has_signals, 5.0, 0.1)
        sig = (await admin.get("/admin/v1/signals")).json()
        assert sig["latest"]["complete"] is False and sig["latest"]["missing"]
        assert sig["history"] and "at" in sig["history"][-1] and "shards" not in sig["history"][-1]
        # this control plane runs no autoscaler (no --autoscale): it says so, with no decisions
        assert (await admin.get("/admin/v1/decisions")).json() == {"autoscaler": False, "decisions": []}

        alerts = (await admin.get("/admin/v1/alerts")).json()
        assert alerts["source"] == "builtin"
        names = {a["name"] for a in alerts["alerts"]}
        assert {"SwitchboardNoHealthyShard", "SwitchboardSignalsIncomplete"} <= names
        assert "SwitchboardDegraded" not in names
        await admin.put("/admin/v1/degradation", json={"level": 4, "reason": "alert test"})
        alerts = (await admin.get("/admin/v1/alerts")).json()["alerts"]
        degraded = next(a for a in alerts if a["name"] == "SwitchboardDegraded")
        assert degraded["severity"] == "critical" and degraded["labels"]["level"] == "4"


async def test_traces_are_assembled_from_members_and_the_control_plane(
    admin_url: str, stub: StubServer
) -> None:
    async with admin_client(admin_url) as admin:
        await admin.put("/admin/v1/degradation", json={"level": 1, "reason": "make a control-plane span"})
        for member_id, url in (("gateway-stub", stub.url), ("gateway-gone", "http://127.0.0.1:9")):
            resp = await admin.put(f"/v1/registry/members/{member_id}",
                                   json={"service": "gateway", "url": url, "ttl_s": 30})
            assert resp.status_code == 200, resp.text
        try:
            body = (await admin.get("/admin/v1/traces", params={"tier": "plus"})).json()
            assert body["sources"]["gateway-stub"] == "ok" and body["sources"]["gateway-gone"] != "ok"
            [stubbed] = body["traces"]
            assert stubbed["trace_id"] == TRACE
            assert stubbed["root"] == "gateway.request" and stubbed["tier"] == "plus"
            assert stubbed["services"] == ["switchboard-gateway", "switchboard-shard"]
            assert stubbed["duration_ms"] == 250.0 and stubbed["status"] == "ok" and stubbed["span_count"] == 3
            assert [s["name"] for s in stubbed["spans"]] == ["gateway.request", "router.route", "shard.generate"]
            # the control plane's own spans are in too (the operator's pin above)
            own = [s for s in (await admin.get("/debug/spans")).json() if s["name"] == "degradation.change"]
            by_id = (await admin.get("/admin/v1/traces", params={"trace_id": own[-1]["trace_id"]})).json()
            assert "degradation.change" in [s["name"] for s in by_id["traces"][0]["spans"]]
            only = (await admin.get("/admin/v1/traces", params={"tier": "plus", "min_ms": 200})).json()["traces"]
            assert [t["trace_id"] for t in only] == [TRACE]
            errors = (await admin.get("/admin/v1/traces", params={"status": "error", "limit": 200})).json()["traces"]
            assert TRACE not in [t["trace_id"] for t in errors]
            assert all(t["status"] == "error" for t in errors)
            # housekeeping (heartbeats, scrapes, state polls) never shows up as chat traces
            routine = {t["root"] for t in (await admin.get("/admin/v1/traces", params={"limit": 200})).json()["traces"]}
            assert not any(r.startswith(("GET /v1/state", "PUT /v1/registry/")) for r in routine)
            by_id = (await admin.get("/admin/v1/traces", params={"trace_id": TRACE})).json()["traces"]
            assert [t["trace_id"] for t in by_id] == [TRACE]
            assert_openai_error(await admin.get("/admin/v1/traces", params={"status": "meh"}), 400)
        finally:
            for member_id in ("gateway-stub", "gateway-gone"):
                await admin.delete(f"/v1/registry/members/{member_id}")


def test_assemble_traces_orders_and_summarises() -> None:
    other = "cd" * 16
    spans = [*STUB_SPANS,
             span("4" * 16, None, "gateway.request", "switchboard-gateway", 2000, 2010, status="ERROR", trace_id=other),
             STUB_SPANS[0]]  # the same span twice (two fetches) counts once
    traces = assemble_traces(spans)
    assert [t["trace_id"] for t in traces] == [other, TRACE]  # most recent first
    assert traces[0]["status"] == "error" and traces[0]["tier"] is None and traces[1]["span_count"] == 3
    # a trace whose root span is not (yet) collected still gets a root: its earliest orphan
    assert assemble_traces(STUB_SPANS[1:])[0]["root"] == "router.route"


def test_a_trace_recovered_by_failover_is_summarised_by_its_root() -> None:
    """A stream resumed on another shard after its first shard stalled: the client got every token in
    6.4 s, but the stalled shard's leg ended in error 21.4 s in, when that shard woke. The list said
    "error, 21412 ms" for a request that had succeeded; the root span is what the client saw."""
    resumed = [
        span("1" * 16, None, "gateway.request", "switchboard-gateway", 0, 6411, **{"switchboard.tier": "plus"}),
        span("2" * 16, "1" * 16, "router.route", "switchboard-gateway", 1, 150),
        span("3" * 16, "2" * 16, "shard.generate", "switchboard-shard", 10, 21412, status="ERROR"),
        span("4" * 16, "2" * 16, "shard.generate", "switchboard-shard", 1990, 6411),
    ]
    [trace] = assemble_traces(resumed)
    assert trace["status"] == "ok" and trace["duration_ms"] == 6411.0 and trace["failed_spans"] == 1
    assert trace["span_count"] == 4  # the failed leg is still in the waterfall
    # the root failing is the request failing, however short its children were
    resumed[0] = span("1" * 16, None, "gateway.request", "switchboard-gateway", 0, 6411, status="ERROR")
    assert assemble_traces(resumed)[0]["status"] == "error"
    # without its root (still streaming, or not collected) the spans we have decide, as before
    [partial] = assemble_traces(resumed[1:])
    assert partial["status"] == "error" and partial["duration_ms"] == 21411.0 and partial["root"] == "router.route"


async def test_alerts_from_alertmanager(tmp_path: Path, stub: StubServer) -> None:
    proc = open_control_plane("--warmup", "0", "--alertmanager", stub.url, log_path=tmp_path / "cp.log").start()
    try:
        async with httpx.AsyncClient(base_url=proc.url, headers=AUTH) as http:
            body = (await http.get("/admin/v1/alerts")).json()
        assert body["source"] == "alertmanager" and body["error"] is None
        [alert] = body["alerts"]
        assert (alert["name"], alert["severity"], alert["state"]) == ("SwitchboardTTFTHigh", "warning", "active")
        assert alert["summary"] == "TTFT p95 above the SLO" and alert["active_at"] == pytest.approx(1714564800.12)
    finally:
        proc.stop()
    down = open_control_plane("--warmup", "0", "--alertmanager", "http://127.0.0.1:9", log_path=tmp_path / "cp2.log").start()
    try:
        async with httpx.AsyncClient(base_url=down.url, headers=AUTH) as http:
            body = (await http.get("/admin/v1/alerts")).json()
        assert body["source"] == "builtin" and "alertmanager" in body["error"]
        assert any(a["name"] == "SwitchboardNoHealthyShard" for a in body["alerts"])
    finally:
        down.stop()


async def test_restart_restores_pinned_level_and_tiers(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = open_control_plane("--warmup", "0", "--state-dir", str(state), log_path=tmp_path / "cp.log").start()
    try:
        async with httpx.AsyncClient(base_url=proc.url, headers=AUTH) as http:
            fresh = (await http.get("/v1/state")).json()
            # only the built-in default: gateways keep their own --tiers-file
            assert fresh["tiers"] is None and fresh["tiers_source"] == "default"
            await http.put("/admin/v1/degradation", json={"level": 2, "reason": "before crash"})
            policy = TierPolicy.default().to_dict()
            policy["tiers"]["free"]["rpm"] = 7
            assert (await http.put("/admin/v1/tiers", json=policy)).status_code == 200
            proc.kill()  # -9: no clean shutdown
            proc.start()
            got = (await http.get("/admin/v1/degradation")).json()
            assert (got["level"], got["pinned"], got["reason"]) == (2, True, "pinned: before crash")
            assert got["history"][-1]["to"] == 2
            tiers = (await http.get("/admin/v1/tiers")).json()
            assert tiers["tiers"]["free"]["rpm"] == 7 and tiers["source"] == "state"
            assert metric_in((await http.get("/metrics")).text, "switchboard_degradation_level") == 2
            assert (await http.get("/v1/state")).json()["degradation"]["pinned"] is True
    finally:
        proc.stop()


def test_a_full_state_disk_keeps_the_ladder_and_the_tiers_moving(tmp_path: Path) -> None:
    """The control plane's state dir on a disk that fills up (a tmpfs, for real): saving degradation.json
    raised, so an operator's pin was a 500 and an automatic change of level never happened (the ladder
    could neither shed under overload nor come back down), and a tier change was a 500. The change is in
    force in memory (gateways get it), the failed save is logged and counted, and saved again once the
    disk has room (the next change writes the file whole)."""
    with small_disk(tmp_path / "state", size="256k") as disk:
        proc = open_control_plane("--warmup", "0", "--state-dir", str(disk.path), log_path=tmp_path / "cp.log").start()
        try:
            with httpx.Client(base_url=proc.url, headers=AUTH, timeout=10) as http:
                assert http.put("/admin/v1/degradation", json={"level": 1, "reason": "before"}).status_code == 200
                disk.fill()
                r = http.put("/admin/v1/degradation", json={"level": 3, "reason": "disk full"})
                assert r.status_code == 200, r.text
                assert http.get("/v1/state").json()["degradation"]["level"] == 3
                policy = TierPolicy.default().to_dict()
                policy["tiers"]["free"]["rpm"] = 7
                assert http.put("/admin/v1/tiers", json=policy).status_code == 200
                assert http.get("/v1/state").json()["tiers"]["tiers"]["free"]["rpm"] == 7
                text = http.get("/metrics").text
                assert metric_in(text, "switchboard_control_plane_state_writes_total", result="error") == 2
                assert metric_in(text, "switchboard_control_plane_state_unsaved") == 2
                assert json.loads((disk.path / "degradation.json").read_text())["level"] == 1  # the old file whole
                disk.free()
                assert http.put("/admin/v1/degradation", json={"level": 2, "reason": "room again"}).status_code == 200
                assert json.loads((disk.path / "degradation.json").read_text())["level"] == 2
                assert metric_in(http.get("/metrics").text, "switchboard_control_plane_state_unsaved") == 1  # tiers
        finally:
            proc.stop()
