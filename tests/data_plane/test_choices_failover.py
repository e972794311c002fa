"""A chat stream of several choices (`n` = 2) whose shard is killed mid-stream (SIGKILL) resumes, each
choice from its own text (data_plane/routing/lanes.py), driven by the openai SDK against real processes
on loopback: synthetic shards (0.25 s a token; the engine continues a reply from its words so far) behind
a registry, cache nodes and a gateway; then two real float32 torch shards behind a gateway, where greedy
decoding makes the resumed stream equal an unbroken one. Which choice is which (different texts) is
checked in tests/data_plane/test_upstream.py.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_choices_failover.py -q    # ~2 min
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.cluster import FP32_SHARD, KEYS, Cluster, static_shards
from tests.support.metrics import metric
from tests.support.procs import Service

ASK = [{"role": "user", "content": "count the lighthouses along the coast"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # a generous silence bound: only the kill should move a stream (2 loaded cores)
    with Cluster(shards=2, caches=2, token_delay_ms=250, gateway_args=["--silence-timeout-s", "30"]) as c:
        yield c


def running(shard: Service) -> float:
    try:
        return metric(shard.url, "vllm:num_requests_running")
    except httpx.HTTPError:
        return 0.0


def texts(c: Cluster, kill_after: int | None = None) -> tuple[dict[int, str], dict[int, str | None], list[Service]]:
    """Each choice's streamed text and finish reason; kills the serving shard after `kill_after` chunks."""
    client = openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=120)
    out: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {0: None, 1: None}
    killed: list[Service] = []
    stream = client.chat.completions.create(model="synthetic", messages=ASK, n=2, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    chunks = 0
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            out[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
            chunks += 1
            if kill_after is not None and chunks == kill_after and not killed:
                (serving,) = [s for s in c.shards if s.proc is not None and s.proc.poll() is None and running(s) > 0]
                serving.kill()
                killed.append(serving)
    assert usage is not None and usage.completion_tokens == 2 * 16 and usage.prompt_tokens > 0, usage
    return out, finish, killed


def test_two_choices_resume_each_from_its_own_text_after_the_shard_is_killed(cluster: Cluster) -> None:
    whole, whole_finish, _ = texts(cluster)
    assert whole[0] and whole_finish == {0: "length", 1: "length"}
    before = metric(cluster.gateway.url, "switchboard_router_resumes_total")
    resumed, finish, killed = texts(cluster, kill_after=8)  # both choices a few words in, 16 words each
    assert killed, "the serving shard was killed mid-stream"
    assert metric(cluster.gateway.url, "switchboard_router_resumes_total") == before + 1
    assert resumed == whole, "each choice continued from its own text, word for word"
    assert finish == whole_finish


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[list[Service], Service]]:
    with static_shards(FP32_SHARD, FP32_SHARD, gateway_args=("--silence-timeout-s", "30"),
                       ready_timeout=240) as (shards, gw):
        yield shards, gw


def test_a_greedy_stream_of_two_choices_resumed_after_its_shard_is_killed_equals_an_unbroken_one(real) -> None:
    """The real model, temperature 0, float32: each choice continued on its own gives the text an unbroken
    stream gives."""
    shards, gw = real
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=180)
    ask = [{"role": "user", "content": "Write a short poem about the sea."}]

    def stream(kill_after: int | None) -> tuple[dict[int, str], list[Service]]:
        out: dict[int, str] = {0: "", 1: ""}
        killed: list[Service] = []
        chunks = 0
        for chunk in client.chat.completions.create(model="", messages=ask, n=2, max_tokens=48, temperature=0,
                                                    stream=True):
            for choice in chunk.choices:
                out[choice.index] += choice.delta.content or ""
                chunks += 1
                if chunks == kill_after:
                    (serving,) = [s for s in shards if s.proc is not None and s.proc.poll() is None and running(s) > 0]
                    serving.kill()
                    killed.append(serving)
        return out, killed

    whole, _ = stream(None)
    before = metric(gw.url, "switchboard_router_resumes_total")
    resumed, killed = stream(12)
    assert killed and metric(gw.url, "switchboard_router_resumes_total") == before + 1
    assert resumed == whole and whole[0] == whole[1] and len(whole[0]) > 40, (whole, resumed)
