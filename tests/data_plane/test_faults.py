"""Faults with real processes (kill -9): a shard dies, a cache node dies."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.cluster import KEYS, Cluster


def post(c: Cluster, body: dict, key: str = KEYS["plus"], headers: dict | None = None) -> httpx.Response:
    return httpx.post(c.gateway.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def metric(c: Cluster, name: str) -> float:
    total = 0.0
    for line in httpx.get(c.gateway.url + "/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_killed_shard_requests_still_succeed_and_it_leaves_routing() -> None:
    with Cluster(shards=2, caches=1, token_delay_ms=1) as c:
        c.shards[0].kill()
        t_kill = time.monotonic()

        async def burst() -> list[int]:
            sdk = openai.AsyncOpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0)
            rs = await asyncio.gather(*(sdk.chat.completions.with_raw_response.create(
                model="synthetic", messages=[{"role": "user", "content": f"q {i}"}], max_tokens=4)
                for i in range(16)))
            await sdk.close()
            return [r.status_code for r in rs]

        # Right after the kill the registry still lists the dead shard: the router must retry.
        assert asyncio.run(burst()) == [200] * 16
        assert metric(c, "switchboard_router_retries_total") >= 1
        # The registry notices (TTL) and the gateway stops routing there.
        c.wait_members(shards=1, caches=1, timeout=5)
        left_after = time.monotonic() - t_kill
        assert left_after < 5
        retries = metric(c, "switchboard_router_retries_total")
        assert asyncio.run(burst()) == [200] * 16
        assert metric(c, "switchboard_router_retries_total") == retries  # no more retries needed
        # A restarted shard rejoins.
        c.shards[0].start()
        c.wait_members(shards=2, caches=1, timeout=10)


def test_killed_cache_node_plus_session_survives() -> None:
    with Cluster(shards=1, caches=3) as c:
        r = post(c, {"messages": [{"role": "user", "content": "remember the word pineapple"}], "max_tokens": 3},
                 headers={"X-Session-Id": "new"})
        assert r.status_code == 200
        sid = r.headers["x-session-id"]
        first_prompt = r.json()["usage"]["prompt_tokens"]
        # Kill each cache node that holds a replica, one at a time (plus tier keeps 2 replicas,
        # and read-repair restores the second copy after each loss).
        for victim in range(2):
            holders = [s for s in c.caches if s.proc.poll() is None and
                       httpx.get(f"{s.url}/v1/sessions/{sid}").status_code == 200]
            assert len(holders) >= 1
            holders[0].kill()
            alive = [s for s in c.caches if s.proc.poll() is None]
            c.wait_members(shards=1, caches=len(alive), timeout=5)
            r = post(c, {"messages": [{"role": "user", "content": "what word"}], "max_tokens": 3},
                     headers={"X-Session-Id": sid})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > first_prompt  # history was replayed
            first_prompt = r.json()["usage"]["prompt_tokens"]
            time.sleep(0.3)  # let read-repair / the write land on the survivors
