"""The control-plane process and its embedded registry, over real HTTP on loopback.

    .venv/bin/python -m pytest tests/control_plane/test_registry.py -q

The control plane runs in the registry's open mode (tests.support.cluster.open_control_plane).
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
from collections.abc import Awaitable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from data_plane.membership.embedded import HttpMembership, RegistrationAgent
from data_plane.membership.view import Member
from tests.support.chat import assert_openai_error
from tests.support.cluster import ADMIN_TOKEN, open_control_plane, unique_id
from tests.support.metrics import metric_in
from tests.support.procs import Service
from tests.support.waits import eventually_async


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log_path = tmp_path_factory.mktemp("cp") / "control-plane.log"
    # a critical member stays listed 3 s: a poll that a loaded machine delays by a second or two still sees it
    proc = open_control_plane("--warmup", "0", "--deregister-critical-after", "3", log_path=log_path).start()
    yield proc
    proc.stop()


async def test_health_and_metrics(control_plane: Service) -> None:
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        text = (await http.get("/metrics")).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"switchboard_membership_members", "switchboard_membership_changes"} <= families
    assert 'switchboard_membership_members{service="shard",status="passing"}' in text


async def test_agent_registers_heartbeats_updates_meta_and_deregisters(
    control_plane: Service,
) -> None:
    member_id = unique_id()
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        before = (await http.get("/metrics")).text
        agent = RegistrationAgent(
            control_plane.url,
            Member(member_id, "shard", "http://127.0.0.1:8101", meta={"model": "m"}),
            http,
            ttl_s=0.6,
        )
        await agent.start()
        assert agent.registered
        first = (await http.get(f"/v1/registry/members/{member_id}")).json()
        assert first["status"] == "passing" and first["meta"] == {"model": "m"} and first["ttl_s"] == 0.6

        async def heartbeat_seen() -> bool:
            now = (await http.get(f"/v1/registry/members/{member_id}")).json()
            return bool(now["last_heartbeat"] > first["last_heartbeat"])

        await eventually_async(heartbeat_seen, timeout_s=1.0)

        agent.set_meta(load="3")

        async def meta_seen() -> bool:
            now = (await http.get(f"/v1/registry/members/{member_id}")).json()
            return bool(now["meta"] == {"model": "m", "load": "3"})

        await eventually_async(meta_seen, timeout_s=1.0)
        await asyncio.sleep(0.8)  # longer than the TTL: heartbeats keep it passing
        assert (await http.get(f"/v1/registry/members/{member_id}")).json()["status"] == "passing"

        await agent.aclose()
        assert_openai_error(await http.get(f"/v1/registry/members/{member_id}"), 404)
        after = (await http.get("/metrics")).text
    for event in ("registered", "deregistered"):
        name = "switchboard_membership_changes_total"
        assert (
            metric_in(after, name, service="shard", event=event)
            == metric_in(before, name, service="shard", event=event) + 1
        )


async def test_blocking_query_wakes_on_change_not_on_heartbeat(control_plane: Service) -> None:
    member_id = unique_id("gateway")
    body = {"service": "gateway", "url": "http://127.0.0.1:8000", "ttl_s": 30}
    async with httpx.AsyncClient(base_url=control_plane.url, timeout=10) as http:
        resp = await http.get("/v1/registry/members", params={"service": "gateway"})
        index = resp.json()["index"]
        assert resp.headers["X-Registry-Index"] == str(index)

        # a blocking query at the current index waits (up to 30 s) and answers on the change
        query = asyncio.create_task(http.get(
            "/v1/registry/members", params={"service": "gateway", "index": index, "wait": 30}, timeout=40))
        done, _ = await asyncio.wait({query}, timeout=0.3)
        assert not done, "a blocking query answered with nothing changed"
        await http.put(f"/v1/registry/members/{member_id}", json=body)
        resp = await asyncio.wait_for(query, 10)  # hang bound: a third of its wait
        new_index = resp.json()["index"]
        assert new_index > index and resp.headers["X-Registry-Index"] == str(new_index)
        assert member_id in [m["id"] for m in resp.json()["members"]]

        # a heartbeat that changes nothing does not wake a blocking query; it waits out `wait`
        params = {"service": "gateway", "index": new_index, "wait": 1.5}
        query = asyncio.create_task(http.get("/v1/registry/members", params=params))
        await asyncio.sleep(0.1)  # the query is in flight (if not, the heartbeat below is simply older)
        await http.put(f"/v1/registry/members/{member_id}", json=body)
        done, _ = await asyncio.wait({query}, timeout=0.5)
        assert not done, "a heartbeat that changed nothing woke a blocking query"
        resp = await asyncio.wait_for(query, 10)  # it waits out its 1.5 s; 10 s is the hang bound
        assert resp.json()["index"] == new_index

        await http.delete(f"/v1/registry/members/{member_id}")


async def test_silent_member_goes_critical_then_is_removed(control_plane: Service) -> None:
    member_id = unique_id()
    body = {"service": "shard", "url": "http://127.0.0.1:8102", "ttl_s": 0.3}
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        before = (await http.get("/metrics")).text
        assert (await http.put(f"/v1/registry/members/{member_id}", json=body)).status_code == 200

        async def status() -> str:
            resp = await http.get(f"/v1/registry/members/{member_id}")
            return str(resp.json()["status"]) if resp.status_code == 200 else "gone"

        # hang bounds: a member that never expired, or was never removed, would wait forever (the reaper runs
        # every 0.2 s; these took 1.5 and 2 s, and failed on a loaded machine)
        await eventually_async(lambda: _eq(status(), "critical"), timeout_s=10.0,
                               what="critical after its 0.3 s TTL (hang bound)")
        # a heartbeat brings it back
        assert (await http.put(f"/v1/registry/members/{member_id}", json=body)).json()["status"] == "passing"
        await eventually_async(lambda: _eq(status(), "critical"), timeout_s=10.0, what="critical again (hang bound)")
        await eventually_async(lambda: _eq(status(), "gone"), timeout_s=15.0,
                               what="removed 3 s after going critical (--deregister-critical-after; hang bound)")
        after = (await http.get("/metrics")).text
    name = "switchboard_membership_changes_total"
    assert (
        metric_in(after, name, service="shard", event="expired")
        >= metric_in(before, name, service="shard", event="expired") + 2
    )


async def _eq(value: Awaitable[str], expected: str) -> bool:
    return await value == expected


async def test_drain_hides_member_until_undrained(control_plane: Service) -> None:
    member_id = unique_id("cache")
    body = {"service": "cache", "url": "http://127.0.0.1:8201", "ttl_s": 30}
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        await http.put(f"/v1/registry/members/{member_id}", json=body)
        # a 30 s blocking query: seeing the drain well inside it means the query answered on the change (with a
        # 2 s query and a 1 s bound, a loaded machine's late poll failed)
        view = HttpMembership(control_plane.url, http, services=("cache",), wait_s=30.0)
        await view.start()
        try:
            assert member_id in [m.id for m in view.members("cache")]

            assert (await http.post(f"/v1/registry/members/{member_id}/drain")).status_code in (404, 405)
            resp = await http.post(f"/admin/v1/members/{member_id}/drain",
                                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert resp.json()["status"] == "draining"
            await eventually_async(lambda: member_id not in [m.id for m in view.members("cache")], timeout_s=10.0,
                                   what="the drain seen (a third of the query's wait)")
            assert [m.status for m in view.all_members("cache") if m.id == member_id] == ["draining"]

            # the member's own heartbeat does not undo the operator's drain
            assert (await http.put(f"/v1/registry/members/{member_id}", json=body)).json()[
                "status"
            ] == "draining"

            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            resp = await http.post(f"/admin/v1/members/{member_id}/undrain", headers=headers)
            assert resp.status_code == 200 and resp.json()["status"] == "passing"
            await eventually_async(lambda: member_id in [m.id for m in view.members("cache")], timeout_s=10.0,
                                   what="the undrain seen (a third of the query's wait)")
        finally:
            await view.aclose()
            await http.delete(f"/v1/registry/members/{member_id}")


async def test_admin_api_needs_the_bearer_token(control_plane: Service) -> None:
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        cases: list[dict[str, str] | dict[bytes, bytes]] = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {ADMIN_TOKEN}"},
            {b"Authorization": "Bearer tökén".encode()},  # non-ASCII must not become a 500
            {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        ]
        for headers in cases:
            resp = await http.get("/admin/v1/members", headers=headers)
            err = assert_openai_error(resp, 401)
            assert err["type"] == "authentication_error"
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        resp = await http.get("/admin/v1/members", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert resp.status_code == 200 and isinstance(resp.json()["members"], list)


BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("PUT", "/v1/registry/members/m1", b"{not json", 400),
    ("PUT", "/v1/registry/members/m1", [1, 2], 400),
    ("PUT", "/v1/registry/members/m1", {"service": "shard"}, 400),
    ("PUT", "/v1/registry/members/m1", {"service": "nope", "url": "http://x"}, 400),
    ("PUT", "/v1/registry/members/m1", {"service": "shard", "url": "ftp://x"}, 400),
    ("PUT", "/v1/registry/members/m1", {"service": "shard", "url": "http://x:99999"}, 400),
    ("PUT", "/v1/registry/members/m1", {"service": "shard", "url": "http://x", "ttl_s": -1}, 400),
    ("PUT", "/v1/registry/members/m1", b'{"service": "shard", "url": "http://x", "ttl_s": 1e400}', 400),
    ("PUT", "/v1/registry/members/m1", b'{"service": "shard", "url": "http://x", "ttl_s": NaN}', 400),
    ("PUT", "/v1/registry/members/m1", {"service": "shard", "url": "http://x", "meta": {"a": 1}}, 400),
    ("PUT", "/v1/registry/members/m1", {"service": "shard", "url": "http://x", "color": "red"}, 400),
    ("PUT", "/v1/registry/members/-bad%20id", {"service": "shard", "url": "http://x"}, 400),
    ("GET", "/v1/registry/members?wait=-1", None, 400),
    ("GET", "/v1/registry/members?wait=nan", None, 400),
    ("GET", "/v1/registry/members?index=abc", None, 400),
    ("GET", "/v1/registry/members?service=bogus", None, 400),
    ("DELETE", "/v1/registry/members/no-such-member", None, 404),
    ("POST", "/v1/registry/members/no-such-member/drain", None, 404),
    ("PATCH", "/v1/registry/members/m1", None, 405),
]


async def test_bad_input_gets_a_4xx_in_the_openai_shape(control_plane: Service) -> None:
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        for method, path, body, status in BAD_REQUESTS:
            if isinstance(body, bytes):
                kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}}
            else:
                kwargs = {} if body is None else {"json": body}
            assert_openai_error(await http.request(method, path, **kwargs), status)


async def test_a_drain_outlives_a_control_plane_restart(tmp_path: pathlib.Path) -> None:
    """kill -9 of the control plane (its supervisor restarts it) used to put a drained shard back into
    rotation: the registry is in memory and the shard's heartbeat re-registered it as passing."""
    state = str(tmp_path / "state")
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"service": "shard", "url": "http://127.0.0.1:8101", "ttl_s": 30}
    first = await asyncio.to_thread(
        open_control_plane("--warmup", "0", "--state-dir", state, log_path=tmp_path / "cp1.log").start)
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as http:
            for member in ("shard-a", "shard-b", "shard-c"):
                assert (await http.put(f"/v1/registry/members/{member}", json=body)).status_code == 200
            for member in ("shard-a", "shard-c"):
                resp = await http.post(f"/admin/v1/members/{member}/drain", headers=admin)
                assert resp.json()["status"] == "draining"
            # shard-c leaves cleanly (the local autoscaler drains, then stops): its id is free again
            assert (await http.delete("/v1/registry/members/shard-c")).status_code == 200
    finally:
        first.kill()
    again = await asyncio.to_thread(open_control_plane(
        "--warmup", "0", "--state-dir", state, port=first.port, log_path=tmp_path / "cp2.log").start)
    try:
        async with httpx.AsyncClient(base_url=again.url, timeout=10) as http:
            status = {}
            for member in ("shard-a", "shard-b", "shard-c"):  # their next heartbeats
                status[member] = (await http.put(f"/v1/registry/members/{member}", json=body)).json()["status"]
            assert status == {"shard-a": "draining", "shard-b": "passing", "shard-c": "passing"}
            routed = (await http.get("/v1/registry/members", params={"service": "shard"})).json()["members"]
            assert {m["id"]: m["draining"] for m in routed} == {"shard-a": True, "shard-b": False, "shard-c": False}
            # undraining is remembered too: a third start leaves shard-a in rotation
            resp = await http.post("/admin/v1/members/shard-a/undrain", headers=admin)
            assert resp.json()["status"] == "passing"
    finally:
        again.kill()
    third = await asyncio.to_thread(open_control_plane(
        "--warmup", "0", "--state-dir", state, port=first.port, log_path=tmp_path / "cp3.log").start)
    try:
        async with httpx.AsyncClient(base_url=third.url, timeout=10) as http:
            resp = await http.put("/v1/registry/members/shard-a", json=body)
            assert resp.json()["status"] == "passing"
    finally:
        third.kill()


async def test_sigterm_answers_blocking_queries_and_exits(tmp_path: pathlib.Path) -> None:
    proc = await asyncio.to_thread(open_control_plane("--warmup", "0", log_path=tmp_path / "cp.log").start)
    try:
        async with httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
            index = (await http.get("/v1/registry/members")).json()["index"]
            query = asyncio.create_task(http.get("/v1/registry/members", params={"index": index, "wait": 30}))
            await asyncio.sleep(0.3)
            assert proc.proc is not None and not query.done()
            proc.proc.send_signal(signal.SIGTERM)
            resp = await asyncio.wait_for(query, 10)  # answered at shutdown, not after its 30 s wait
            assert resp.status_code == 200
            await asyncio.to_thread(proc.proc.wait, 5)
    finally:
        proc.kill()
    assert "Application shutdown complete" in proc.log_tail()


async def test_joining_needs_the_cluster_token(tmp_path: pathlib.Path) -> None:
    """With a cluster token, register and deregister are refused without it (a member is sent
    user prompts); reads stay open; the agent presents the token it is given."""
    cp = open_control_plane("--warmup", "0", "--cluster-token", "s3cret-cluster", log_path=tmp_path / "cp.log").start()
    member_id = unique_id()
    body = {"service": "shard", "url": "http://127.0.0.1:8101"}
    try:
        async with httpx.AsyncClient(base_url=cp.url) as http:
            err = assert_openai_error(await http.put(f"/v1/registry/members/{member_id}", json=body), 401)
            assert err["code"] == "invalid_cluster_token"
            for bad in ("Bearer wrong", "s3cret-cluster", "Basic s3cret-cluster"):
                resp = await http.put(f"/v1/registry/members/{member_id}", json=body, headers={"authorization": bad})
                assert_openai_error(resp, 401)
            assert (await http.get("/v1/registry/members")).json()["members"] == []

            intruder = RegistrationAgent(cp.url, Member(unique_id(), "shard", "http://127.0.0.1:9"), http,
                                         token="guess")
            assert not await intruder.heartbeat()
            agent = RegistrationAgent(cp.url, Member(member_id, "shard", "http://127.0.0.1:8101"), http,
                                      token="s3cret-cluster")
            await agent.start()
            assert agent.registered
            members = (await http.get("/v1/registry/members")).json()["members"]
            assert [m["id"] for m in members] == [member_id]

            assert_openai_error(await http.delete(f"/v1/registry/members/{member_id}"), 401)
            assert_openai_error(await http.get("/metrics"), 401)  # /metrics is guarded by the same token
            text = (await http.get("/metrics", headers={"authorization": "Bearer s3cret-cluster"})).text
            assert metric_in(text, "switchboard_membership_refused_total", method="PUT") == 5
            assert metric_in(text, "switchboard_membership_refused_total", method="DELETE") == 1
            await agent.aclose()  # deregisters with the token
            assert (await http.get("/v1/registry/members")).json()["members"] == []
    finally:
        cp.stop()
    log_text = cp.log_path.read_text()
    assert "no cluster token" not in log_text
    assert "refused PUT /v1/registry/members/" in log_text and "s3cret-cluster" not in log_text


async def test_without_a_cluster_token_the_open_registry_is_logged(control_plane: Service) -> None:
    assert "no cluster token (SWITCHBOARD_CLUSTER_TOKEN)" in control_plane.log_path.read_text()


async def test_an_absent_members_drain_mark_can_be_cleared(tmp_path: pathlib.Path) -> None:
    """Review: a drained member that died without deregistering (kill -9 after a drain, or killed by
    the local actuator when it ignored SIGTERM) kept its mark, undrain answered 404 while it was
    away, and the next process under its id was born drained. Undrain now clears an absent id's
    mark (and only a mark: an unknown id is still a 404)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"service": "shard", "url": "http://127.0.0.1:8102", "ttl_s": 30}
    cp = await asyncio.to_thread(open_control_plane(
        "--warmup", "0", "--state-dir", str(tmp_path / "state"), log_path=tmp_path / "cp.log").start)
    try:
        async with httpx.AsyncClient(base_url=cp.url, timeout=10) as http:
            assert (await http.put("/v1/registry/members/shard-x", json=body)).status_code == 200
            assert (await http.post("/admin/v1/members/shard-x/drain", headers=admin)).status_code == 200
        cp.kill()  # the member is gone with the registry's memory; its mark is on disk
        cp.start()
        async with httpx.AsyncClient(base_url=cp.url, timeout=10) as http:
            resp = await http.post("/admin/v1/members/shard-x/undrain", headers=admin)
            assert resp.status_code == 200 and resp.json() == {"id": "shard-x", "status": "absent", "draining": False}
            assert (await http.put("/v1/registry/members/shard-x", json=body)).json()["status"] == "passing"
            assert (await http.post("/admin/v1/members/shard-never/undrain", headers=admin)).status_code == 404
    finally:
        cp.kill()


async def test_a_stopped_control_plane_does_not_expire_its_members_when_it_runs_again(tmp_path: pathlib.Path) -> None:
    """QA: the control plane SIGSTOPped 37 s marked every shard, cache node and gateway critical when it ran
    again (its reaper ran before the heartbeats queued meanwhile were read) and called its zone DOWN. Time it
    did not run is not counted against its members; one that stays silent afterwards still expires."""
    proc = await asyncio.to_thread(open_control_plane("--warmup", "0", log_path=tmp_path / "cp.log").start)
    try:
        async with httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
            member = Member(unique_id(), "shard", "http://127.0.0.1:8103")
            agent = RegistrationAgent(proc.url, member, http, ttl_s=0.6)
            await agent.start()
            silent = unique_id()
            await http.put(f"/v1/registry/members/{silent}",
                           json={"service": "shard", "url": "http://127.0.0.1:8104", "ttl_s": 0.6})
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(2.0)  # > 3 TTLs: heartbeats queue up (or time out) meanwhile
            finally:
                proc.proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.3)  # the reaper's overdue tick, then the heartbeats
            text = (await http.get("/metrics")).text
            assert metric_in(text, "switchboard_membership_changes_total", service="shard", event="expired") == 0
            assert (await http.get(f"/v1/registry/members/{member.id}")).json()["status"] == "passing"

            async def silent_expired() -> bool:
                return bool((await http.get(f"/v1/registry/members/{silent}")).json()["status"] == "critical")

            await eventually_async(silent_expired, timeout_s=10.0, what="the silent member expires (hang bound)")
            await agent.aclose()
    finally:
        proc.kill()
    assert "did not run for" in proc.log_tail()
