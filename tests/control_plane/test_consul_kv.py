"""The control plane's Consul side: KV for desired state and policies, members for the admin API.
Runs against the Consul HTTP STUB (tests/support/consul_stub.py) and, when ``CONSUL_HTTP_ADDR`` is set,
against that live agent too.

    .venv/bin/python -m pytest tests/control_plane/test_consul_kv.py -q

Each test writes under its own KV prefix and service prefix, and cleans up after itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from control_plane.registry.consul import ConsulKV, ConsulMembers
from data_plane.common.errors import NotFound, UpstreamError
from data_plane.membership.consul import ConsulRegistrationAgent
from data_plane.membership.view import Member
from tests.support.cluster import ADMIN_TOKEN, open_control_plane
from tests.support.consul_stub import ConsulStub, consul_agent, consul_client
from tests.support.procs import free_port
from tests.support.waits import eventually_async


@pytest.fixture(scope="module", params=["stub", "live"])
def consul_url(request: pytest.FixtureRequest) -> Iterator[str]:
    with consul_agent(request.param) as url:
        yield url


@contextlib.asynccontextmanager
async def kv_store(consul_url: str) -> AsyncIterator[ConsulKV]:
    """A ConsulKV under a prefix of its own, emptied afterwards."""
    prefix = f"switchboard-test-{uuid.uuid4().hex[:8]}/"
    async with consul_client() as http:
        store = ConsulKV(consul_url, http, prefix=prefix)
        try:
            yield store
        finally:
            await store.delete("", recurse=True)


async def test_put_get_list_delete(consul_url: str) -> None:
    async with kv_store(consul_url) as kv:
        assert await kv.get("policies/tiers") is None
        assert await kv.put("policies/tiers", "free:\n  rpm: 10\n")
        entry = await kv.get("policies/tiers")
        assert entry is not None and entry.key == "policies/tiers" and entry.text() == "free:\n  rpm: 10\n"
        assert await kv.put_json("desired/host-a/shards", {"replicas": 3})
        assert await kv.put("desired/host-b/shards", b"")  # Consul answers an empty value as null
        listed = await kv.list("desired/")
        assert sorted(listed) == ["desired/host-a/shards", "desired/host-b/shards"]
        assert listed["desired/host-a/shards"].json() == {"replicas": 3}
        assert listed["desired/host-b/shards"].value == b""
        assert await kv.delete("desired/host-a/shards")
        assert await kv.get("desired/host-a/shards") is None
        assert await kv.delete("desired/", recurse=True)
        assert await kv.list("desired/") == {}
        assert await kv.get("policies/tiers") is not None


async def test_check_and_set(consul_url: str) -> None:
    async with kv_store(consul_url) as kv:
        assert await kv.put_json("desired/shards", {"replicas": 2}, cas=0)  # 0: only if absent
        assert not await kv.put_json("desired/shards", {"replicas": 9}, cas=0)
        entry = await kv.get("desired/shards")
        assert entry is not None
        assert await kv.put_json("desired/shards", {"replicas": 3}, cas=entry.modify_index)
        assert not await kv.put_json("desired/shards", {"replicas": 4}, cas=entry.modify_index)  # someone wrote first
        now = await kv.get("desired/shards")
        assert now is not None and now.json() == {"replicas": 3} and now.modify_index > entry.modify_index


async def test_watch_blocks_until_the_key_changes(consul_url: str) -> None:
    async with kv_store(consul_url) as kv:
        index, entry = await kv.watch("desired/shards")  # index 0: answers at once
        assert entry is None and index >= 1

        watch = asyncio.create_task(kv.watch("desired/shards", index, wait_s=30.0))
        done, _ = await asyncio.wait({watch}, timeout=0.3)
        assert not done, "the watch answered with nothing changed"
        await kv.put_json("desired/shards", {"replicas": 5})
        index2, entry = await asyncio.wait_for(watch, 10)  # on the change; 10 s is the hang bound
        assert entry is not None and entry.json() == {"replicas": 5} and index2 > index
        watch = asyncio.create_task(kv.watch("desired/shards", index2, wait_s=1.0))  # nothing changes
        done, _ = await asyncio.wait({watch}, timeout=0.5)
        assert not done, "the watch answered with nothing changed"
        index3, same = await asyncio.wait_for(watch, 10)  # waits out its 1 s
        assert index3 == index2 and same == entry


async def test_bad_keys_and_unreachable_consul() -> None:
    async with consul_client() as http:
        kv = ConsulKV(f"consul://127.0.0.1:{free_port()}", http)
        with pytest.raises(ValueError):
            await kv.get("../etc")
        with pytest.raises(UpstreamError) as err:
            await kv.get("desired/shards")
        assert err.value.status == 502 and err.value.code == "consul_unavailable"


async def test_members_lists_every_status_and_drains_with_maintenance(consul_url: str) -> None:
    prefix = f"sbtest{uuid.uuid4().hex[:8]}-"
    async with consul_client() as http:
        members = ConsulMembers(consul_url, http=http, service_prefix=prefix)
        await members.start()
        assert members.snapshot() == (members.snapshot()[0], []) and not members.warming_up
        shard = ConsulRegistrationAgent(consul_url, Member(f"{prefix}shard-0", "shard", "http://127.0.0.1:8101",
                                                           meta={"model": "m"}), http, ttl_s=1.0,
                                        service_prefix=prefix)
        gateway = ConsulRegistrationAgent(consul_url, Member(f"{prefix}gateway-0", "gateway", "http://127.0.0.1:8000"),
                                          http, ttl_s=1.0, service_prefix=prefix)
        try:
            await shard.start()
            await gateway.start()
            await eventually_async(lambda: len(members.snapshot()[1]) == 2, timeout_s=2.0)
            listed = {m["id"]: m for m in members.snapshot()[1]}
            assert listed[f"{prefix}shard-0"]["status"] == "passing"
            assert listed[f"{prefix}shard-0"]["meta"] == {"model": "m"}
            assert listed[f"{prefix}gateway-0"]["service"] == "gateway"

            drained = await members.maintenance(f"{prefix}shard-0", True)
            assert drained["status"] == "draining" and drained["draining"]
            await eventually_async(lambda: [m["status"] for m in members.snapshot("shard")[1]] == ["draining"], 2.0)
            members.set_draining(f"{prefix}shard-0", False)  # the Registry-compatible call: in the background
            await eventually_async(lambda: [m["status"] for m in members.snapshot("shard")[1]] == ["passing"], 2.0)
            with pytest.raises(NotFound):
                members.set_draining(f"{prefix}nobody", True)
        finally:
            await shard.aclose()
            await gateway.aclose()
        await eventually_async(lambda: members.snapshot()[1] == [], timeout_s=2.0)
        await members.aclose()


def test_control_plane_reads_members_from_consul(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--membership consul://…``: no embedded registry; the admin API lists what Consul holds."""
    with ConsulStub() as stub:
        cp = open_control_plane("--membership", stub.membership_url, log_path=tmp_path_factory.mktemp("cp") / "cp.log")
        cp.start()
        try:
            assert httpx.get(f"{cp.url}/v1/registry/members").status_code == 404  # not hosted here
            auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

            async def register_and_watch() -> None:
                async with consul_client() as http:
                    agent = ConsulRegistrationAgent(stub.membership_url, Member("shard-9", "shard",
                                                    "http://127.0.0.1:8109"), http, ttl_s=1.0)
                    await agent.start()

                    async def listed() -> list[str]:
                        body = (await http.get(f"{cp.url}/admin/v1/members", headers=auth)).json()
                        return [f"{m['id']}:{m['status']}" for m in body["members"]]

                    async def shows(expected: list[str]) -> bool:
                        return await listed() == expected

                    await eventually_async(lambda: shows(["shard-9:passing"]), timeout_s=3.0)
                    resp = await http.post(f"{cp.url}/admin/v1/members/shard-9/drain", headers=auth)
                    assert resp.status_code == 200, resp.text
                    await eventually_async(lambda: shows(["shard-9:draining"]), timeout_s=3.0)
                    await agent.aclose()
                    await eventually_async(lambda: shows([]), timeout_s=3.0)

            asyncio.run(register_and_watch())
        finally:
            cp.stop()
