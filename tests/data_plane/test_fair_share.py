"""Fair share inside a tier, as users of a running gateway see it: one free tenant floods, another
free tenant sends a request now and then; the light one keeps its unloaded TTFT, the flood is shed.

    .venv/bin/python -m pytest tests/data_plane/test_fair_share.py -q -s      # ~25 s

Real processes on loopback: a control plane, one synthetic shard (100 ms per token, 8 slots: the
free tier may fill 6), one gateway with a short admission queue. The light tenant's requests ask
for one token, so their time to the answer is their time to first token.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Self

import httpx
import pytest

from tests.support.cluster import ADMIN_TOKEN, LIFTED_TIERS
from tests.support.procs import Service

FLOOD_KEY, LIGHT_KEY = "sk-test-flood-0123456789", "sk-test-light-0123456789"
KEYS_ENV = f"{FLOOD_KEY}:flood:free,{LIGHT_KEY}:light:free"
FLOOD_CLIENTS = 40


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def _light_ttfts(url: str, n: int, pause_s: float) -> tuple[list[float], list[int]]:
    out, statuses = [], []
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {LIGHT_KEY}"}) as client:
        for _ in range(n):
            sent = time.perf_counter()
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                           "max_tokens": 1})
            statuses.append(r.status_code)
            if r.status_code == 200:
                out.append(time.perf_counter() - sent)
            time.sleep(pause_s)
    return out, statuses


class Flood:
    """`FLOOD_CLIENTS` closed-loop clients of one tenant in a background thread; a shed request
    (503) waits 50 ms before the next, as a client honouring a short back-off would."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Self:
        self.began = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.seconds = time.monotonic() - self.began

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=FLOOD_CLIENTS)
        async with httpx.AsyncClient(base_url=self.url, timeout=30, limits=limits,
                                     headers={"Authorization": f"Bearer {FLOOD_KEY}"}) as http:
            async def client() -> None:
                while not self._stop.is_set():
                    r = await http.post("/v1/chat/completions",
                                        json={"messages": [{"role": "user", "content": "flood"}], "max_tokens": 1})
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(client() for _ in range(FLOOD_CLIENTS)))




@pytest.fixture
def stack(tmp_path):  # type: ignore[no-untyped-def]
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(LIFTED_TIERS)
    cp = Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0", "--tiers-file", str(tiers)])
    shard = Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", "shard-0",
                     "--synthetic-token-delay-ms", "100", "--max-num-seqs", "8"])
    gateway = Service(["gateway", "--registry-url", cp.url, "--tokenizer", "whitespace", "--model-name", "synthetic",
                       "--queue-size", "8", "--tiers-file", str(tiers)], env={"SWITCHBOARD_GATEWAY_API_KEYS": KEYS_ENV})
    try:
        cp.start()
        shard.start()
        gateway.start()
        deadline = time.monotonic() + 30
        while httpx.get(gateway.url + "/health", timeout=2).json().get("shards", 0) < 1:
            assert time.monotonic() < deadline, "no shard"
            time.sleep(0.2)
        yield gateway
    finally:
        for svc in (gateway, shard, cp):
            svc.stop()


def test_a_flooding_tenant_is_shed_while_a_light_tenant_of_its_tier_keeps_its_ttft(stack: Service) -> None:
    url = stack.url
    _light_ttfts(url, 3, 0.05)  # warm the connections and the gateway's paths
    unloaded, _ = _light_ttfts(url, 20, 0.05)
    with Flood(url) as flood:
        time.sleep(2.0)  # the flood fills the free tier's slots and the queue
        loaded, statuses = _light_ttfts(url, 30, 0.1)
        flood_statuses = list(flood.statuses)
    shed, served = flood_statuses.count(503), flood_statuses.count(200)
    assert shed + served == len(flood_statuses), sorted(set(flood_statuses))
    base, under = _p95(unloaded), _p95(loaded)
    print(f"\nlight TTFT p95: unloaded {base * 1000:.0f} ms, under the flood {under * 1000:.0f} ms "
          f"({under / base:.2f}x); flood: {served} served, {shed} shed (503)")
    assert statuses == [200] * 30, statuses  # the light tenant is never shed
    # The flood is shed, and served no faster than the free tier's 6 slots allow: a request holds a
    # slot for at least one 100 ms token. (Not "shed > served": how fast 40 clients cycle through 503s
    # is the test process's CPU, not the gateway's policy; with a busy core beside the suite the flood
    # read 341 served, 302 shed, both within the policy.)
    assert shed > 0 and served > 0, (served, shed)
    assert served <= 6 * flood.seconds / 0.100 + 6, (served, flood.seconds)
    # The typical light request keeps its unloaded time (queued behind the flood it would wait whole
    # 100 ms steps: 2x and more); the p95 of 30 is the second-worst sample, and a test beside this one
    # on the 2 cores (CI runs two at a time) can delay any single request by a step: it gets 3x.
    base_mid, under_mid = statistics.median(unloaded), statistics.median(loaded)
    assert under_mid <= 2 * base_mid, f"light TTFT median {under_mid:.3f}s > 2x unloaded {base_mid:.3f}s"
    assert under <= 3 * base, f"light TTFT p95 {under:.3f}s > 3x unloaded {base:.3f}s"
