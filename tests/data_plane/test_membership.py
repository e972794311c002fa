"""Membership clients against a real control-plane process on loopback.

.venv/bin/python -m pytest tests/data_plane/test_membership.py -q
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from data_plane.membership.embedded import HttpMembership, RegistrationAgent
from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.fleet import ShardFleet
from tests.support.cluster import open_control_plane, unique_id
from tests.support.procs import ROOT as REPO
from tests.support.procs import Service, free_port
from tests.support.waits import eventually_async

# A member process that registers with ttl 1 s and then just lives until it is SIGKILLed.
AGENT_SCRIPT = """
import asyncio, sys, httpx
from data_plane.membership.embedded import RegistrationAgent
from data_plane.membership.view import Member

async def main():
    registry_url, member_id = sys.argv[1:3]
    async with httpx.AsyncClient() as http:
        agent = RegistrationAgent(registry_url, Member(member_id, "shard", "http://127.0.0.1:9"), http, ttl_s=1.0)
        await agent.start()
        print("registered" if agent.registered else "not registered", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def ids(members: list[Member]) -> list[str]:
    return [m.id for m in members]


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    proc = open_control_plane("--warmup", "0", log_path=tmp_path_factory.mktemp("cp") / "control-plane.log").start()
    yield proc
    proc.stop()


def test_static_membership_lists_routable_members_sorted() -> None:
    view = StaticMembership(
        [
            Member("shard-b", "shard", "http://127.0.0.1:8102"),
            Member("shard-a", "shard", "http://127.0.0.1:8101", meta={"model": "m"}),
            Member("shard-c", "shard", "http://127.0.0.1:8103", status="draining"),
            Member("shard-d", "shard", "http://127.0.0.1:8104", status="critical"),
            Member("cache-a", "cache", "http://127.0.0.1:8201"),
        ]
    )
    assert ids(view.members("shard")) == ["shard-a", "shard-b"]
    assert ids(view.members("cache")) == ["cache-a"]
    assert view.members("gateway") == []
    assert hash(view.members("shard")[0])  # frozen and hashable despite the meta mapping


async def test_http_membership_sees_members_come_and_go(control_plane: Service) -> None:
    member = Member(unique_id(), "shard", "http://127.0.0.1:8101", meta={"model": "SmolLM2-135M-Instruct"})
    async with httpx.AsyncClient() as http:
        # a 30 s blocking query: seeing the member well inside it means the query answered on the change
        view = HttpMembership(control_plane.url, http, wait_s=30.0)
        changes: list[float] = []
        view.subscribe(lambda: changes.append(time.monotonic()))
        await view.start()
        assert view.reachable and view.last_sync > 0
        agent = RegistrationAgent(control_plane.url, member, http, ttl_s=1.0)
        try:
            await agent.start()
            await eventually_async(lambda: member.id in ids(view.members("shard")), timeout_s=10.0,
                                   what="the member seen (hang bound, a third of the query's wait)")
            seen = next(m for m in view.members("shard") if m.id == member.id)
            assert seen.url == member.url and seen.meta == member.meta and seen.status == "passing"
            assert changes

            quiet_since = len(changes)
            await asyncio.sleep(1.0)  # heartbeats alone are not changes
            assert len(changes) == quiet_since
        finally:
            await agent.aclose()
        await eventually_async(lambda: member.id not in ids(view.members("shard")), timeout_s=10.0,
                               what="the member's leave seen (hang bound, a third of the query's wait)")
        assert len(changes) > quiet_since
        await view.aclose()


async def test_a_cache_nodes_meta_change_is_no_change_to_the_routers_shard_fleet(control_plane: Service) -> None:
    """A cache node announces its KV bytes in its meta every 10 s under load; the view then lists
    the shards afresh, with newer heartbeat times. The router's fleet took that for a shard change:
    in the soak of `switchboard up` the gateway rebuilt its rings and logged "routing view: 2 shards
    (change N)" every few seconds with the same two shards throughout."""
    shard = Member(unique_id("shard"), "shard", "http://127.0.0.1:8101", meta={"zone": "local"})
    cache = Member(unique_id("cache"), "cache", "http://127.0.0.1:8201")
    async with httpx.AsyncClient() as http:
        view = HttpMembership(control_plane.url, http, wait_s=30.0)
        agents = [RegistrationAgent(control_plane.url, m, http, ttl_s=0.6) for m in (shard, cache)]

        def ours() -> list[Member]:  # other tests' members share the registry
            return [m for m in view.members("shard") if m.id == shard.id]

        await view.start()
        try:
            for agent in agents:
                await agent.start()
            await eventually_async(lambda: ours() and any(m.id == cache.id for m in view.members("cache")),
                                   timeout_s=10.0, what="both members seen")
            fleet = ShardFleet()
            assert fleet.sync(ours()) and fleet.changes == 1
            beats = {ours()[0].last_heartbeat}
            for mib in range(1, 4):
                agents[1].set_meta(kv_bytes=str(mib << 20))
                await eventually_async(lambda: any(m.meta.get("kv_bytes") == str(mib << 20)  # noqa: B023
                                                   for m in view.members("cache")), timeout_s=10.0)
                beats.add(ours()[0].last_heartbeat)
                assert not fleet.sync(ours()), (mib, fleet.changes)
            assert len(beats) > 1  # the shard's listing did move on meanwhile
            assert fleet.changes == 1
        finally:
            for agent in agents:
                await agent.aclose()
            await view.aclose()


async def test_killed_member_leaves_within_its_ttl(control_plane: Service) -> None:
    member_id = unique_id()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", AGENT_SCRIPT, control_plane.url, member_id]
    agent = await asyncio.create_subprocess_exec(
        *cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert agent.stdout is not None
        line = await asyncio.wait_for(agent.stdout.readline(), 15)
        assert line.strip() == b"registered"
        async with httpx.AsyncClient() as http:
            view = HttpMembership(control_plane.url, http, wait_s=5.0)
            await view.start()
            try:
                assert member_id in ids(view.members("shard"))
                await asyncio.sleep(0.7)  # mid heartbeat cycle
                agent.kill()  # no deregistration: only the TTL can notice
                # it leaves by its TTL expiring (nobody deregistered it): critical, not gone
                await eventually_async(lambda: member_id not in ids(view.members("shard")), timeout_s=5.0,
                                       what="the killed member out of routing (hang bound; its TTL is 1 s)")
                assert [m.status for m in view.all_members("shard") if m.id == member_id] == ["critical"]
            finally:
                await view.aclose()
    finally:
        if agent.returncode is None:
            agent.kill()
        await agent.wait()


async def test_clients_never_raise_when_the_registry_is_down() -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient() as http:
        view = HttpMembership(nowhere, http, wait_s=1.0)
        agent = RegistrationAgent(
            nowhere, Member("shard-x", "shard", "http://127.0.0.1:8101"), http, ttl_s=0.6
        )
        await view.start()
        await agent.start()
        await asyncio.sleep(0.5)  # the watch and heartbeat loops keep retrying quietly
        assert not view.reachable and view.last_sync == 0.0 and view.members("shard") == []
        assert not agent.registered
        await agent.aclose()
        await view.aclose()


async def test_registry_restart_keeps_routing_and_members_come_back(tmp_path: pathlib.Path) -> None:
    registry = await asyncio.to_thread(open_control_plane("--warmup", "0", log_path=tmp_path / "cp.log").start)
    live = Member(unique_id(), "shard", "http://127.0.0.1:8101")
    gone = Member(unique_id("cache"), "cache", "http://127.0.0.1:8201")  # registered once, never again
    try:
        async with httpx.AsyncClient() as http:
            put = {"service": gone.service, "url": gone.url, "ttl_s": 30}
            assert (
                await http.put(f"{registry.url}/v1/registry/members/{gone.id}", json=put)
            ).status_code == 200
            agent = RegistrationAgent(registry.url, live, http, ttl_s=1.0)
            view = HttpMembership(registry.url, http, wait_s=2.0)
            await agent.start()
            await view.start()
            try:
                assert ids(view.members("shard")) == [live.id] and ids(view.members("cache")) == [gone.id]
                synced = view.last_sync

                registry.kill()
                await eventually_async(lambda: not view.reachable, timeout_s=2.0)
                await asyncio.sleep(1.2)  # past every TTL: the last list still routes
                assert ids(view.members("shard")) == [live.id] and ids(view.members("cache")) == [gone.id]
                assert not agent.registered

                registry.stop()  # already dead: closes its log
                registry = open_control_plane("--warmup", "1.5", log_path=tmp_path / "cp.log", port=registry.port)
                await asyncio.to_thread(registry.start)  # same port, empty memory
                await eventually_async(lambda: view.reachable, timeout_s=3.0)
                assert view.last_sync > synced

                async def live_reregistered() -> bool:
                    resp = await http.get(f"{registry.url}/v1/registry/members", params={"service": "shard"})
                    return [(m["id"], m["status"]) for m in resp.json()["members"]] == [(live.id, "passing")]

                await eventually_async(live_reregistered, timeout_s=2.0)
                assert agent.registered
                # while the new registry warms up it may not know everyone yet: keep what we had
                assert ids(view.members("cache")) == [gone.id]
                await eventually_async(lambda: view.members("cache") == [], timeout_s=3.0)
                assert ids(view.members("shard")) == [live.id]
            finally:
                await agent.aclose()
                await view.aclose()
    finally:
        registry.stop()
