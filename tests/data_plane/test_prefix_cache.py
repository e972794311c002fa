"""Prefix caching in a real torch shard (float32): a conversation's next turn computes only its
new tokens, tenants never share KV, and reuse never changes greedy output (batched, mixed
lengths, and under a budget small enough to evict all the time)."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from tests.support.formats import INVARIANT_ARGS
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service

BLOCK = 16
SYSTEM = ("You are a careful assistant for a bicycle shop. Answer briefly and precisely, name parts by "
          "their usual names, and never invent prices. ") * 2


def ask(url: str, messages: list[dict[str, str]], salt: str | None = "tenant-a", max_tokens: int = 24,
        request_id: str | None = None) -> dict:
    body: dict = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
    if salt is not None:
        body["cache_salt"] = salt
    if request_id:
        body["request_id"] = request_id
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_second_turn_computes_only_its_new_tokens(fp32_shard: Service) -> None:
    url = fp32_shard.url
    salt = uuid.uuid4().hex  # a fresh scope: nothing earlier in the session can hit
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a derailleur do?"}]
    r1 = ask(url, turn1, salt)
    assert cached(r1) == 0
    p1, o1 = r1["usage"]["prompt_tokens"], r1["usage"]["completion_tokens"]
    # What turn 1's slot held: its prompt and output (the last sampled token is never fed back
    # when the turn ends on max_tokens; an end-of-turn token is not an output token).
    in_kv = p1 + o1 - (1 if r1["choices"][0]["finish_reason"] == "length" else 0)
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And a cassette?"}]
    before = {name: metric(url, name) for name in (
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm:request_prefill_kv_computed_tokens_sum", "vllm:prompt_tokens_cached_total",
        "vllm:kv_block_reuse_gap_seconds_count")}
    by_source = {(name, source): metric(url, name, source=source) for name, source in (
        ("vllm:prompt_tokens_by_source_total", "local_cache_hit"), ("vllm:prompt_tokens_by_source_total", "local_compute"),
        ("vllm:prompt_tokens_cached_by_source_total", "device"))}
    rid = uuid.uuid4().hex
    r2 = ask(url, turn2, salt, request_id=rid)
    p2 = r2["usage"]["prompt_tokens"]
    assert cached(r2) == in_kv // BLOCK * BLOCK, (cached(r2), in_kv)
    delta = {name: metric(url, name) - v for name, v in before.items()}
    assert delta["vllm:prefix_cache_queries_total"] == p2
    assert delta["vllm:prefix_cache_hits_total"] == cached(r2)
    assert delta["vllm:prompt_tokens_cached_total"] == cached(r2)
    assert delta["vllm:request_prefill_kv_computed_tokens_sum"] == p2 - cached(r2) < BLOCK + (p2 - in_kv)
    assert delta["vllm:kv_block_reuse_gap_seconds_count"] >= cached(r2) // BLOCK  # each reused block: one gap
    moved = {key: metric(url, key[0], source=key[1]) - v for key, v in by_source.items()}
    assert moved == {("vllm:prompt_tokens_by_source_total", "local_cache_hit"): cached(r2),
                     ("vllm:prompt_tokens_by_source_total", "local_compute"): p2 - cached(r2),
                     ("vllm:prompt_tokens_cached_by_source_total", "device"): cached(r2)}
    span = next(s for s in httpx.get(url + "/debug/spans", headers=CLUSTER_HEADERS).json()
                if s["name"] == "shard.generate" and s["attributes"].get("switchboard.request_id") == rid)
    event = next(e for e in span["events"] if e["name"] == "prefix_cache")
    assert event["attributes"] == {"tokens_cached": cached(r2), "tokens_computed": p2 - cached(r2)}


def test_another_tenants_identical_prompt_gets_no_hit(fp32_shard: Service) -> None:
    url = fp32_shard.url
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Hello {uuid.uuid4().hex}"}]
    a1, a2 = ask(url, messages, "tenant-a"), ask(url, messages, "tenant-a")
    b = ask(url, messages, "tenant-b")
    anonymous = ask(url, messages, None)
    assert cached(a1) == 0 and cached(a2) >= BLOCK
    assert cached(b) == 0 and cached(anonymous) == 0
    assert a1["choices"][0]["message"] == a2["choices"][0]["message"] == b["choices"][0]["message"]


def conversations() -> list[list[dict[str, str]]]:
    """Mixed lengths that share prefixes: a shared system prompt, and growing transcripts."""
    out = []
    for topic in ("brakes", "tyres", "chains"):
        history = [{"role": "system", "content": SYSTEM}]
        for turn, q in enumerate((f"Tell me about {topic}.", "Why?", "Give one more detail, in a sentence.")):
            history = history + [{"role": "user", "content": q}]
            out.append(list(history))
            history = history + [{"role": "assistant", "content": f"About {topic}, point {turn}: it matters."}]
    return out


async def _all_at_once(url: str, prompts: list[list[dict[str, str]]], max_tokens: list[int]) -> list[str]:
    async with httpx.AsyncClient(timeout=300, headers=CLUSTER_HEADERS) as http:
        async def one(messages: list[dict[str, str]], m: int) -> str:
            r = await http.post(url + "/v1/chat/completions", json={
                "messages": messages, "temperature": 0, "max_tokens": m, "cache_salt": "t"})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        return list(await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens))))


@pytest.fixture(scope="module")
def reuse_shards():
    """A shard without prefix caching, and one whose budget holds only 12 blocks (it evicts all
    the time, and marks SYSTEM public), both in the session shard's batch-invariant format."""
    off = Service(["shard", *INVARIANT_ARGS, "--max-num-seqs", "12", "--prefix-caching", "off"],
                  ready_timeout=180)
    tiny = Service(["shard", *INVARIANT_ARGS, "--max-num-seqs", "12",
                    "--prefix-cache-bytes", str(12 * 737280), "--kv-public-prefix", json.dumps([SYSTEM])],
                   ready_timeout=180)
    off.start(wait=False)
    tiny.start(wait=False)
    try:
        off.wait_healthy()
        tiny.wait_healthy()
        yield off, tiny
    finally:
        off.stop()
        tiny.stop()


@pytest.mark.slow
def test_greedy_output_is_identical_with_and_without_reuse(fp32_shard: Service, reuse_shards) -> None:
    off, tiny = reuse_shards
    prompts = conversations()
    max_tokens = [12, 30, 20, 8, 26, 16, 22, 10, 28]
    reference = [ask(off.url, p, "t", max_tokens=m)["choices"][0]["message"]["content"]
                 for p, m in zip(prompts, max_tokens)]
    for shard in (fp32_shard, tiny):
        solo_warm = [ask(shard.url, p, "t", max_tokens=m)["choices"][0]["message"]["content"]
                     for p, m in zip(prompts, max_tokens)]   # each one hits what the previous left
        hits = metric(shard.url, "vllm:prefix_cache_hits_total")
        batched = asyncio.run(_all_at_once(shard.url, prompts, max_tokens))
        assert metric(shard.url, "vllm:prefix_cache_hits_total") > hits
        assert solo_warm == reference and batched == reference
    assert metric(tiny.url, "switchboard_shard_prefix_cache_evictions_total", reason="capacity") > 0
    assert metric(off.url, "vllm:prefix_cache_hits_total") == 0


@pytest.mark.slow
def test_an_operator_marked_public_system_prompt_is_shared_across_tenants(reuse_shards) -> None:
    _, shard = reuse_shards
    tag = uuid.uuid4().hex
    first = ask(shard.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Hi {tag}"}], "a")
    other = ask(shard.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Yo {tag}"}], "b")
    private = ask(shard.url, [{"role": "system", "content": SYSTEM + " Be terse."},
                              {"role": "user", "content": f"Hi {tag}"}], "a")
    same = ask(shard.url, [{"role": "system", "content": SYSTEM + " Be terse."},
                           {"role": "user", "content": f"Hi {tag}"}], "b")
    # Tenant b reuses the public system prompt's blocks, and only those (its question is salted);
    # tenant a found them too if an earlier test left them (public means shared).
    assert BLOCK <= cached(other) <= first["usage"]["prompt_tokens"] - BLOCK
    assert cached(first) in (0, cached(other))
    # A system prompt that is not marked public is not shared: b gets nothing of a's.
    assert cached(private) == 0 and cached(same) == 0


def test_a_reply_reenters_the_prompt_as_the_tokens_generated(fp32_shard: Service) -> None:
    """SmolLM2 emits "\\n\\n" as one token before a word, which its tokenizer splits in two when the
    reply comes back as text: restored to the generated tokens, the next turn still hits it all."""
    url = fp32_shard.url
    salt = uuid.uuid4().hex
    turn1 = [{"role": "user", "content": "Explain step by step how a bicycle works, covering the frame and gears."}]
    r1 = ask(url, turn1, salt, max_tokens=40)
    reply = r1["choices"][0]["message"]["content"]
    assert "\n\n" in reply, reply   # the case this test is about
    in_kv = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - (r1["choices"][0]["finish_reason"] == "length")
    restored = metric(url, "switchboard_shard_transcript_tokens_restored_total")
    r2 = ask(url, turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the brakes?"}],
             salt)
    assert cached(r2) == in_kv // BLOCK * BLOCK
    assert metric(url, "switchboard_shard_transcript_tokens_restored_total") == restored + 1
