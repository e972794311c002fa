"""Token-exact transcripts through the whole stack (real gateway, cache node and float32 torch
shard): each turn of a session reuses the KV of everything the previous turn's slot held, which
only works if turn N+1's rendered prompt starts with exactly turn N's prompt + output tokens
(chat template, transcript text, output filter and stop handling all preserve them). When the
sliding window drops old turns the prefix changes by nature: the gateway counts it."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import Cluster
from tests.support.formats import INVARIANT_ARGS
from tests.support.metrics import metric

BLOCK = 16
QUESTIONS = [
    "Describe how a bicycle chain transfers power from the pedals to the rear wheel, in some detail.",
    "Now explain what the derailleur does when the rider changes gear, and why the chain must move.",
    "What goes wrong when a chain is worn out or stretched, and how would a mechanic measure it?",
    "Finally, how often should a chain be cleaned and oiled, and which kind of oil should be used?",
    "Summarise everything so far in a few short sentences for a beginner who has never fixed a bike.",
    "One more question: what tools does a beginner need for basic bicycle maintenance at home?",
]


@pytest.fixture(scope="module")
def stack():
    with Cluster(shards=1, caches=1, engine="torch",
                 shard_args=[*INVARIANT_ARGS, "--max-num-seqs", "4", "--max-model-len", "448"]) as c:
        yield c


def turn(c: Cluster, session: str, content: str, **kw: object) -> httpx.Response:
    r = httpx.post(c.gateway.url + "/v1/chat/completions", timeout=180,
                   headers={"authorization": f"Bearer {c.keys['plus']}", "x-session-id": session},
                   json={"messages": [{"role": "user", "content": content}], "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.slow
def test_each_turn_reuses_all_the_previous_turns_tokens_until_the_window_slides(stack: Cluster) -> None:
    c = stack
    shard = c.shards[0].url
    r = turn(c, "new", QUESTIONS[0], max_tokens=64)
    session = r.headers["x-session-id"]
    body = r.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    slid, exact = False, 0
    for i, q in enumerate(QUESTIONS[1:], start=1):
        prev = body
        # What the previous turn's slot held: prompt + output (the last token sampled is never fed
        # back when it stopped on max_tokens; the end-of-turn token is not an output token).
        in_kv = (prev["usage"]["prompt_tokens"] + prev["usage"]["completion_tokens"]
                 - (prev["choices"][0]["finish_reason"] == "length"))
        slides = metric(c.gateway.url, "switchboard_gateway_context_slides_total")
        computed = metric(shard, "vllm:request_prefill_kv_computed_tokens_sum")
        body = turn(c, session, q, max_tokens=64, **({"stop": ["\n\n\n"]} if i == 2 else {})).json()
        got = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert metric(shard, "vllm:request_prefill_kv_computed_tokens_sum") - computed == \
            body["usage"]["prompt_tokens"] - got
        if metric(c.gateway.url, "switchboard_gateway_context_slides_total") > slides:
            slid = True   # older turns left the window: only the template's system prompt still matches
            assert got < in_kv // BLOCK * BLOCK
            break
        assert got == in_kv // BLOCK * BLOCK, f"turn {i}: {got} cached of {in_kv} the previous turn held"
        exact += 1
    assert slid, "the window never slid: make the conversation longer"
    assert exact >= 2, f"only {exact} turns before the window slid"
