"""A Responses chain and a conversation outlive the shard that served them (kill -9): the next turn,
on the surviving shard, gets its context from the cache nodes (the record, and the KV blocks), with
the real model (float32, greedy) and the openai SDK.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_responses_failover.py -q   # ~3 min

One cluster for the module: control plane, two cache nodes, two fp32 shards, a gateway. The first
test kills a shard and starts a fresh one in its place for the second.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.support.cluster import KEYS, Cluster
from tests.support.formats import INVARIANT_ARGS
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service
from tests.support.waits import eventually

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_TOKENS = 16
SHARD_ARGS = [*INVARIANT_ARGS, "--max-num-seqs", "4", "--speculation", "off"]
STORY = ("Tell me, in plain words, how a bicycle's gears, chain and derailleur work together when a rider "
         "climbs a steep hill, and why the cassette has so many sprockets. ")
FOLLOW_UP = "And when going downhill?"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(shards=2, caches=2, engine="torch", shard_args=SHARD_ARGS,
                gateway_args=["--silence-timeout-s", "60"])  # the API is under test, not failover timing
    for svc in (c.control_plane, *c.caches, c.gateway):
        svc.ready_timeout = 240  # two cores shared by a loaded machine: start-up can take minutes
    c.start()
    try:
        yield c
    finally:
        c.stop()


def total(url: str, name: str, **labels: str) -> float:
    try:
        return metric(url, name, **labels)
    except (AssertionError, KeyError, StopIteration, ValueError, httpx.HTTPError):
        return 0.0


def finished(shard: Service) -> float:
    return sum(total(shard.url, "vllm:request_success_total", finished_reason=r) for r in ("length", "stop"))


def sdk(c: Cluster, key: str = KEYS["plus"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=key, max_retries=0, timeout=300)


def reference(shard: Service, messages: list[dict[str, str]]) -> dict:
    """The same turn computed from scratch on `shard` (a fresh salt: nothing cached matches)."""
    r = httpx.post(shard.url + "/v1/chat/completions", timeout=300, headers=CLUSTER_HEADERS,
                   json={"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
                         "cache_salt": uuid.uuid4().hex, "request_id": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    return r.json()


def turn_one_then_kill(c: Cluster, first: Callable[[], str]) -> tuple[str, Service]:
    """Run `first` (turn 1, returns its output text), find the shard that served it, wait for its
    KV blocks to reach the cache nodes, kill -9 it; (turn 1's text, the survivor)."""
    done = {s.url: finished(s) for s in c.shards}
    stored = {s.url: total(s.url, "switchboard_shard_kv_offload_blocks_total", result="stored") for s in c.shards}
    text = first()
    owner = next(s for s in c.shards if finished(s) > done[s.url])
    eventually(lambda: total(owner.url, "switchboard_shard_kv_offload_blocks_total", result="stored")
               > stored[owner.url], 60, what="turn 1's KV blocks on the cache nodes")
    owner.kill()
    survivor = next(s for s in c.shards if s is not owner)
    c.shards = [survivor]
    c.wait_members(1, len(c.caches))
    return text, survivor


def check_turn_two(survivor: Service, first_text: str, answer: str, cached: int, input_tokens: int,
                   hits_before: float) -> None:
    fetched = total(survivor.url, "vllm:external_prefix_cache_hits_total") - hits_before
    assert fetched >= 4 * BLOCK, ("the chain's prefix came from the cache nodes", fetched, cached, input_tokens)
    assert cached == fetched  # usage says served from the fetched KV, not computed
    # the right context: the same prompt (turn 1 and its answer, then the follow-up) from scratch
    ref = reference(survivor, [{"role": "user", "content": STORY * 3},
                               {"role": "assistant", "content": first_text},
                               {"role": "user", "content": FOLLOW_UP}])
    assert input_tokens == ref["usage"]["prompt_tokens"]
    assert answer == ref["choices"][0]["message"]["content"]


def test_chain_survives_its_shard_killed(cluster: Cluster) -> None:
    client = sdk(cluster)
    first: list[str] = []

    def turn_one() -> str:
        r = client.responses.create(model="SmolLM2-135M-Instruct", input=STORY * 3, temperature=0,
                                    max_output_tokens=MAX_TOKENS)
        first.append(r.id)
        return r.output_text

    text, survivor = turn_one_then_kill(cluster, turn_one)
    hits = total(survivor.url, "vllm:external_prefix_cache_hits_total")
    r2 = client.responses.create(model="SmolLM2-135M-Instruct", input=FOLLOW_UP, previous_response_id=first[0],
                                 temperature=0, max_output_tokens=MAX_TOKENS)
    assert r2.previous_response_id == first[0]
    assert r2.usage is not None and r2.usage.input_tokens_details is not None
    check_turn_two(survivor, text, r2.output_text, r2.usage.input_tokens_details.cached_tokens,
                   r2.usage.input_tokens, hits)
    # a fresh shard in the killed one's place, for the next test
    fresh = Service(["shard", "--engine", "torch", "--registry-url", cluster.registry, "--node-id", "shard-2",
                     *SHARD_ARGS], ready_timeout=180).start()
    cluster.shards.append(fresh)
    cluster.wait_members(2, len(cluster.caches))


def test_conversation_survives_its_shard_killed(cluster: Cluster) -> None:
    # Another tenant than the chain test's (another cache salt): the shard that survived that test
    # holds its prompt, its greedy answer and the chat template's leading blocks in its own prefix
    # cache, so with the same tenant, when this conversation's first turn went to the fresh shard
    # (the ring's choice for a random conversation id, about one time in two) the survivor served
    # turn 2 from local blocks: nothing fetched, or fewer blocks fetched than cached.
    client = sdk(cluster, KEYS["enterprise"])
    conv = client.conversations.create(metadata={"topic": "bikes"})

    def turn_one() -> str:
        r = client.responses.create(model="SmolLM2-135M-Instruct", input=STORY * 3, conversation=conv.id,
                                    temperature=0, max_output_tokens=MAX_TOKENS)
        return r.output_text

    text, survivor = turn_one_then_kill(cluster, turn_one)
    hits = total(survivor.url, "vllm:external_prefix_cache_hits_total")
    r2 = client.responses.create(model="SmolLM2-135M-Instruct", input=FOLLOW_UP, conversation=conv.id,
                                 temperature=0, max_output_tokens=MAX_TOKENS)
    assert r2.usage is not None and r2.usage.input_tokens_details is not None
    check_turn_two(survivor, text, r2.output_text, r2.usage.input_tokens_details.cached_tokens,
                   r2.usage.input_tokens, hits)
    items = client.conversations.items.list(conv.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 4
