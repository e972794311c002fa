"""Rate limits and priority admission through real gateways (synthetic shards, loopback).

    .venv/bin/python -m pytest tests/data_plane/test_gateway_limits.py -q     # ~30 s

One gateway (local limiter, one in-flight slot) shows the headers, 429s (also through the
openai SDK), settlement and the admission queue; three gateways on one real redis-server
show that a shared limit holds across replicas (the anchors overshoot by the replica count,
litellm#40291). The Redis tests skip when `redis-server` is not on PATH.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, ROOT, Service
from tests.support.redis import RedisServer
from tests.support.waits import eventually, eventually_async

KEYS = {
    "free": "sk-lim-free-0123456789",       # rpm 3
    "free2": "sk-lim-free2-0123456789",     # another free key, for the admission deadline
    "bulk": "sk-lim-bulk-0123456789",       # priority 2 like free, but a large rpm: queue ordering
    "plus": "sk-lim-plus-0123456789",       # tpm 600
    "plus2": "sk-lim-plus2-0123456789",
    "plus3": "sk-lim-plus3-0123456789",
    "enterprise": "sk-lim-ent-0123456789",
}
TIERS = {"tiers": {
    "free": {"priority": 2, "rpm": 3, "tpm": 20000, "max_context_tokens": 2048, "max_output_tokens": 256,
             "replication": 1, "shed_order": 0},
    "bulk": {"priority": 2, "rpm": 6000, "tpm": 2000000, "max_context_tokens": 2048, "max_output_tokens": 256,
             "replication": 1, "shed_order": 0},
    "plus": {"priority": 1, "rpm": 600, "tpm": 600, "max_context_tokens": 2048, "max_output_tokens": 1024,
             "replication": 1, "shed_order": 1},
    "enterprise": {"priority": 0, "rpm": 6000, "tpm": 2000000, "max_context_tokens": 2048,
                   "max_output_tokens": 1024, "replication": 1, "shed_order": 2},
}}
HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")]
RESET = re.compile(r"^(\d+h)?(\d+m)?\d+(\.\d+)?(ms|s)$")


def keys_env(names: list[str]) -> dict[str, str]:
    tier = {"free2": "free", "plus2": "plus", "plus3": "plus"}
    return {"SWITCHBOARD_GATEWAY_API_KEYS": ",".join(f"{KEYS[n]}:acme:{tier.get(n, n)}" for n in names)}


def gateway(shard_url: str, tiers_file: Path, *extra: str, env: dict[str, str]) -> Service:
    return Service(["gateway", "--shard-urls", shard_url, "--tokenizer", "whitespace", "--model-name", "synthetic",
                    "--tiers-file", str(tiers_file), *extra], env=env)


def chat(url: str, key: str, *, max_tokens: int | None = 4, content: str = "hi", stream: bool = False,
         timeout: float = 30) -> httpx.Response:
    body = {"model": "synthetic", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}
    if max_tokens is None:
        del body["max_tokens"]
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=timeout)


def estimate(content: str, max_tokens: int) -> int:
    """The gateway's admission estimate with the whitespace counter (data_plane/gateway/context.py)."""
    return len(content.split()) + 1 + 5 + 3 + max_tokens


@pytest.fixture(scope="module")
def tiers_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "tiers.yaml"
    path.write_text(yaml.safe_dump(TIERS))
    return path


@pytest.fixture(scope="module")
def one(tiers_file: Path) -> Iterator[Service]:
    """One gateway with one in-flight slot; a full synthetic answer (16 tokens) takes about 1 s. Bulk waits up to
    60 s in the admission queue (its tier's default is 5 s): behind the admission test's 7.7 s holder."""
    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "60"]) as shard, \
            gateway(shard.url, tiers_file, "--max-inflight", "1", "--queue-timeouts", "free=1.5,bulk=60",
                    env=keys_env(list(KEYS))) as gw:
        yield gw


def test_every_chat_response_carries_the_openai_ratelimit_headers(one: Service) -> None:
    first = chat(one.url, KEYS["enterprise"])
    second = chat(one.url, KEYS["enterprise"], stream=True)
    for r in (first, second):
        assert r.status_code == 200, r.text
        assert all(h in r.headers for h in HEADERS), r.headers
        assert RESET.match(r.headers["x-ratelimit-reset-requests"]) and RESET.match(r.headers["x-ratelimit-reset-tokens"])
    assert first.headers["x-ratelimit-limit-requests"] == "6000" and first.headers["x-ratelimit-limit-tokens"] == "2000000"
    assert int(first.headers["x-ratelimit-remaining-requests"]) == 5999  # a fresh key, refilling at 100/s
    assert first.headers["x-ratelimit-reset-requests"] == "10ms"  # one request at 6000/min


def test_over_the_rpm_limit_is_429_with_retry_after_before_any_shard_work(one: Service) -> None:
    admitted_before = metric(one.url, "switchboard_gateway_ttft_seconds_count", tier="free")
    for _ in range(3):
        assert chat(one.url, KEYS["free"], max_tokens=1).status_code == 200
    r = chat(one.url, KEYS["free"], max_tokens=1)
    assert r.status_code == 429
    # OpenAI's body: {"type": "requests", "code": "rate_limit_exceeded"} (it was type rate_limit_error)
    assert r.json()["error"]["type"] == "requests" and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 20  # 3/min: a request back every 20 s
    assert r.headers["x-ratelimit-remaining-requests"] == "0" and all(h in r.headers for h in HEADERS)
    streamed = chat(one.url, KEYS["free"], stream=True)  # refused before the first SSE byte
    assert streamed.status_code == 429 and streamed.headers["content-type"].startswith("application/json")
    assert "retry-after" in streamed.headers

    sdk = openai.OpenAI(base_url=one.url + "/v1", api_key=KEYS["free"], max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.RateLimitError) as info:
        sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=1)
    assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
    assert int(info.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=1, stream=True)

    assert metric(one.url, "switchboard_gateway_ttft_seconds_count", tier="free") == admitted_before + 3
    assert metric(one.url, "switchboard_ratelimit_rejections_total", tier="free", kind="requests") >= 4


def test_tokens_are_estimated_then_settled_with_real_usage(one: Service) -> None:
    t0 = time.monotonic()
    first = chat(one.url, KEYS["plus2"], max_tokens=500)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 600 - estimate("hi", 500) + 2
    time.sleep(0.2)  # settlement runs in its own task right after the response
    second = chat(one.url, KEYS["plus2"], max_tokens=1)
    refill = (time.monotonic() - t0) * 600 / 60  # tokens the bucket may have refilled meanwhile
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 600 - used - estimate("hi", 1) - 1 <= remaining <= 600 - used - estimate("hi", 1) + refill + 1


def test_a_request_larger_than_the_tpm_limit_is_refused(one: Service) -> None:
    r = chat(one.url, KEYS["plus"], max_tokens=1000)
    assert r.status_code == 429 and "Request too large" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "tokens"  # the limit it does not fit, as OpenAI names it
    assert r.headers["retry-after"] == "60" and r.headers["x-ratelimit-limit-tokens"] == "600"
    assert r.headers["x-should-retry"] == "false"  # it never fits: retrying it only waits
    assert metric(one.url, "switchboard_ratelimit_rejections_total", tier="plus", kind="tokens") >= 1


def test_a_request_without_max_tokens_gets_a_default_cap_that_fits_the_tpm(one: Service) -> None:
    """plus: TPM 600, output cap 1024. A request without max_tokens was counted with the whole cap, so "hi" needed
    1035 tokens and every such request of the tier was refused as too large, forever. Its default cap is now
    what the minute's tokens leave after the prompt, and the reply stops there (finish_reason "length")."""
    r = chat(one.url, KEYS["plus"], max_tokens=None)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"  # the synthetic answer (16 tokens) fits the room
    # Such a request reserves the whole minute until it is settled: the next one waits for the refill of what the
    # last one used (429, retry-after-ms under a second), which the SDK waits out. The Responses API too.
    time.sleep(0.3)  # settlement runs in its own task right after the response
    sdk = openai.OpenAI(base_url=one.url + "/v1", api_key=KEYS["plus"], timeout=30)  # default max_retries (2)
    assert sdk.responses.create(model="synthetic", input="hi", store=False).status == "completed"
    words = 581  # the room left: 600 - (581 + 9) = 10 tokens
    content = " ".join(["word"] * words)
    body = {"model": "synthetic", "messages": [{"role": "user", "content": content}], "ignore_eos": True}  # without it the synthetic engine ends every answer after 16 tokens
    long = httpx.post(one.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['plus3']}"})
    assert long.status_code == 200, long.text
    assert long.json()["choices"][0]["finish_reason"] == "length"
    assert long.json()["usage"]["completion_tokens"] == 600 - estimate(content, 0) == 10
    assert 0 <= int(long.headers["x-ratelimit-remaining-tokens"]) <= 1  # the estimate took the whole minute
    big = chat(one.url, KEYS["plus2"], max_tokens=None, content=" ".join(["word"] * 600))  # the prompt alone
    assert big.status_code == 429 and "prompt leaves no room" in big.json()["error"]["message"]
    assert "prompt leaves no room" not in chat(one.url, KEYS["plus"], max_tokens=1000).json()["error"]["message"]


def test_the_sdk_does_not_retry_a_request_larger_than_the_tpm_limit(one: Service) -> None:
    """With its default retries the SDK waited Retry-After (60 s) twice and sent the same refused request three
    times; the gateway now tells it not to retry: one request, raised at once."""
    before = metric(one.url, "switchboard_ratelimit_rejections_total", tier="plus", kind="tokens") or 0
    sdk = openai.OpenAI(base_url=one.url + "/v1", api_key=KEYS["plus"], timeout=30)  # default max_retries (2)
    with pytest.raises(openai.RateLimitError) as info:
        sdk.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=1000)
    assert "Request too large" in info.value.message
    assert metric(one.url, "switchboard_ratelimit_rejections_total", tier="plus", kind="tokens") == before + 1


async def test_admission_serves_enterprise_first_and_sheds_free_past_its_deadline(one: Service) -> None:
    order: list[str] = []

    async def call(client: httpx.AsyncClient, name: str) -> httpx.Response:
        # the holder keeps the one slot ~7.7 s (128 tokens at 60 ms), past free2's 1.5 s deadline and what the
        # checks take under a loaded CI (with 16 tokens and a 0.4 s deadline, free2 was shed before a scrape saw
        # it queued). It sends ignore_eos: the synthetic engine ends every answer after 16 tokens (~1 s) else,
        # and enterprise-late, sent after three scrapes, could find the slot free and be served after the bulk.
        hold = name == "enterprise-hold"
        body = {"model": "synthetic", "messages": [{"role": "user", "content": f"{name} question"}],
                "max_tokens": 128 if hold else 16, "ignore_eos": hold}
        r = await client.post(one.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {KEYS[name.split('-')[0]]}"})
        order.append(name)
        return r

    async with httpx.AsyncClient(timeout=60) as client:
        def depth(tier: str) -> float:
            return metric(one.url, "switchboard_admission_queue_depth", tier=tier)

        holder = asyncio.create_task(call(client, "enterprise-hold"))
        await eventually_async(lambda: metric(one.url, "switchboard_admission_inflight") == 1, 10,
                               what="the one slot taken")  # the rest queue
        bulk = [asyncio.create_task(call(client, f"bulk-{i}")) for i in range(2)]
        await eventually_async(lambda: depth("bulk") == 2, 10, what="both bulk requests queued")
        free = asyncio.create_task(call(client, "free2"))

        def free2_queued() -> bool:  # waiting, or already shed at its deadline: either way it was queued
            return depth("free") == 1 or metric(one.url, "switchboard_admission_shed_total", tier="free",
                                                reason="deadline") == 1

        # not a race with free2's 1.5 s deadline: a test that polled late, on a loaded machine, found it shed and
        # the queue empty, and failed
        await eventually_async(free2_queued, 10, what="free2 queued")
        ent = asyncio.create_task(call(client, "enterprise-late"))
        shed = await free
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "overloaded", shed.text
        assert "x-ratelimit-remaining-requests" in shed.headers
        # When a free slot is likely (it was always 2 s): the holder, in flight for >= free2's 1.5 s wait and so
        # held >= 3 s, then a slot each for the two bulk requests queued ahead of a retry
        assert 4 <= int(shed.headers["retry-after"]) <= 60, shed.headers
        results = await asyncio.gather(holder, *bulk, ent)
    # The shed request was given back to free2's 3 RPM (it used to count): a retry is its first request.
    retry = chat(one.url, KEYS["free2"], max_tokens=1)
    assert retry.status_code == 200 and retry.headers["x-ratelimit-remaining-requests"] == "2", retry.headers
    assert [r.status_code for r in results] == [200] * 4
    served = [n for n in order if n != "free2"]
    assert served[:2] == ["enterprise-hold", "enterprise-late"] and set(served[2:]) == {"bulk-0", "bulk-1"}, order
    assert metric(one.url, "switchboard_admission_shed_total", tier="free", reason="deadline") == 1
    assert metric(one.url, "switchboard_admission_wait_seconds_count", tier="bulk") == 2
    assert metric(one.url, "switchboard_admission_queue_depth", tier="bulk") == 0
    assert metric(one.url, "switchboard_admission_inflight") == 0


def test_ratelimit_and_admission_spans(one: Service) -> None:
    trace_id = "1af7651916cd43dd8448eb211c80319c"
    r = httpx.post(one.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "trace"}], "max_tokens": 1},
                   headers={"Authorization": f"Bearer {KEYS['enterprise']}",
                            "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    assert r.status_code == 200
    want = {"gateway.request", "ratelimit", "admission.queue", "router.route"}

    def names() -> set[str]:
        return {s["name"] for s in httpx.get(one.url + "/debug/spans", params={"trace_id": trace_id},
                                             headers=CLUSTER_HEADERS).json()}

    eventually(lambda: want <= names(), 10, what=f"spans {want}")  # recorded when they end
    spans = httpx.get(one.url + "/debug/spans", params={"trace_id": trace_id}, headers=CLUSTER_HEADERS).json()
    by_name = {s["name"]: s for s in spans}
    assert by_name["ratelimit"]["attributes"]["switchboard.ratelimit.allowed"] is True
    assert by_name["admission.queue"]["attributes"]["switchboard.admission.outcome"] == "admitted"


def test_bench_tiers_reports_every_tier(one: Service, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"key": KEYS[t], "tenant": "acme", "tier": t}
                                             for t in ("free", "plus", "enterprise")]}))
    out = tmp_path / "tiers.json"
    proc = subprocess.run([sys.executable, "-m", "control_plane.cli", "bench", "tiers", "--url", one.url,
                           "--keys-file", str(keys), "--duration", "1.5", "--rate", "4", "--baseline", "2",
                           "--max-tokens", "2", "--json", str(out)], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["tier"] for r in result["tiers"]] == ["free", "plus", "enterprise"]
    for row in result["tiers"]:
        assert row["requests"] == row["admitted"] + row["shed_429"] + row["shed_503_queue"] + \
            row["shed_503_ladder"] + row["errors"]
    assert result["baseline"]["ttft_p95_ms"] > 0 and "enterprise TTFT p95" in proc.stdout


# -- three gateways, one Redis -----------------------------------------------------------------


@pytest.fixture(scope="module")
def three(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    tiers = {"tiers": {"free": {**TIERS["tiers"]["free"], "rpm": 60}}}
    path = tmp_path_factory.mktemp("redis-limits") / "tiers.yaml"
    path.write_text(yaml.safe_dump(tiers))
    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "0"]) as shard:
        gws = [gateway(shard.url, path, "--ratelimit-backend", "redis", "--redis-url", redis_server.url,
                       env=keys_env(["free"])) for _ in range(3)]
        try:
            for g in gws:
                g.start(wait=False)
            for g in gws:
                g.wait_healthy()
            yield gws
        finally:
            for g in gws:
                g.stop()


async def test_three_gateways_on_one_redis_admit_one_limit_not_three(three: list[Service]) -> None:
    limit, per_gateway = 60, 60  # alone, each gateway would admit 60: 180 in all

    async def hammer(client: httpx.AsyncClient, url: str) -> list[int]:
        sem = asyncio.Semaphore(12)

        async def one() -> int:
            async with sem:
                r = await client.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['free']}"},
                                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                return r.status_code

        return await asyncio.gather(*(one() for _ in range(per_gateway)))

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        t0 = time.monotonic()
        statuses = [s for batch in await asyncio.gather(*(hammer(client, g.url) for g in three)) for s in batch]
        elapsed = time.monotonic() - t0
    admitted = statuses.count(200)
    allowance = limit * (1 + elapsed / 60)  # the burst plus the continuous refill while the test ran
    print(f"3 gateways, one key at {limit} RPM: admitted {admitted} of {len(statuses)} in {elapsed:.2f}s "
          f"(exact allowance {allowance:.1f}; per-gateway limits would admit {3 * limit})")
    assert statuses.count(429) == len(statuses) - admitted
    assert limit <= admitted <= allowance
    per = [metric(g.url, "switchboard_ratelimit_rejections_total", tier="free", kind="requests") for g in three]
    assert sum(per) == len(statuses) - admitted and all(p > 0 for p in per)  # every gateway refused some


def test_an_unreachable_redis_fails_open_to_local_limits(three: list[Service], redis_server: RedisServer) -> None:
    for _ in range(200):  # exhaust the shared bucket (it refills 1/s, so do not rely on the last test)
        r = chat(three[0].url, KEYS["free"], max_tokens=1)
        if r.status_code == 429:
            break
    assert r.status_code == 429  # over the shared limit
    redis_server.stop()
    r = chat(three[0].url, KEYS["free"], max_tokens=1)
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "59"  # this gateway's own bucket
    assert metric(three[0].url, "switchboard_ratelimit_backend_up") == 0
    assert metric(three[0].url, "switchboard_ratelimit_backend_errors_total", op="take") >= 1
