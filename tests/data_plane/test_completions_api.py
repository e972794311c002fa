"""`POST /v1/completions`, the legacy Completions API (it answered 404): the openai SDK's
`client.completions.create`, streamed and not, a raw prompt (no chat template) as text or token ids,
several prompts, n, stop, logprobs in the legacy format, echo, and OpenAI-shaped 400s naming the param.
Real processes: the session's fp32 shard (greedy output is batch-invariant), a cache node and a gateway.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_completions_api.py -q
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.chat import refusal, sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service
from tests.support.waits import eventually

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("completions")) as gw:
        yield gw


def test_a_prompt_is_completed_as_it_is_streamed_or_not(gateway: Service) -> None:
    """The SDK's completions.create is served: a text_completion whose text continues the prompt itself (its
    few prompt tokens: no chat template around it), the same text streamed, the usage on the last chunk."""
    client = sdk(gateway)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.object == "text_completion" and done.id.startswith("cmpl-") and done.model == MODEL
    (choice,) = done.choices
    assert choice.index == 0 and choice.text and choice.finish_reason in ("length", "stop")
    assert choice.logprobs is None
    assert done.usage is not None and 3 <= done.usage.prompt_tokens <= 8  # a chat template would add ~30
    assert done.usage.completion_tokens <= 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == done.usage.total_tokens

    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=2, temperature=0)
    assert ids.usage is not None and ids.usage.prompt_tokens == 5  # token ids, exactly


def test_several_prompts_n_echo_stop_and_logprobs(gateway: Service) -> None:
    """A list of prompts with n: choices prompt_index * n + i; echo puts each prompt before its text; a stop
    string ends the text before it; logprobs are the legacy lists, one entry per token of the text."""
    client = sdk(gateway)
    prompts = [PROMPT, "One, two, three,"]
    done = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    texts = [c.text for c in done.choices]
    assert texts[0].startswith(PROMPT) and texts[2].startswith(prompts[1])
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: each prompt's own
    assert done.usage is not None and done.usage.completion_tokens <= 4 * 6

    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    word = plain.split()[1] if len(plain.split()) > 1 else plain.split()[0]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[word])
    assert stopped.choices[0].text == plain[: plain.index(word)] and stopped.choices[0].finish_reason == "stop"

    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and "".join(logprobs.tokens) == lp.choices[0].text
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == len(logprobs.tokens)
    assert logprobs.top_logprobs is not None and all(2 <= len(t) <= 3 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                              stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert tokens == logprobs.tokens


def test_bad_requests_are_openai_shaped_400s_naming_the_param(gateway: Service) -> None:
    client = sdk(gateway)
    cases = [({"suffix": "x"}, "suffix"), ({"best_of": 3, "n": 2}, "best_of"), ({"logprobs": 6}, "logprobs"),
             ({"extra_body": {"bogus": 1}}, "bogus"),
             ({"temperature": 3}, "temperature"), ({"stop": [""]}, "stop")]
    for fields, param in cases:
        body = refusal(lambda f=fields: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **f))
        assert body["param"] == param and body["type"] == "invalid_request_error", body
    body = refusal(lambda: client.completions.create(model=MODEL, prompt=[1] * 3000, max_tokens=2))
    assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt"), body
    # a negative id killed the engine, the shard with it; one past 2**32 was a 500 (the gateway's decode for the
    # input filters overflowed)
    for prompt in ([], [5, -1], [[5], [-1]], [5, 10**9], [5, 2**32], [[5], [2**63]]):
        body = refusal(lambda p=prompt: client.completions.create(model=MODEL, prompt=p, max_tokens=2))
        assert body["param"] in ("prompt", "prompt.1"), body
    assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=1).choices[0].finish_reason
    # the shard's raw-prompt fields are the gateway's: a chat client cannot set them
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['plus']}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "raw_prompt": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "raw_prompt"
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(gateway.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['plus']}"},
                   json={"model": MODEL, "prompt": "x" * (2 << 20)}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert metric(gateway.url, "switchboard_gateway_endpoint_requests_total", endpoint="completions",
                  status="400") >= len(cases) + 2
    assert metric(gateway.url, "switchboard_gateway_endpoint_requests_total", endpoint="completions",
                  status="200") >= 0


def test_a_token_id_prompt_is_screened_by_the_input_filters_as_its_text_is(gateway: Service) -> None:
    """The input filters read what a token-id prompt spells (the gateway decodes it with the model's tokenizer):
    sent as ids, a card number the default policy refuses as text went to the shard unscreened."""
    from tokenizers import Tokenizer

    from data_plane.model_store import resolve_model

    client = sdk(gateway)
    text = "Charge my card 4111 1111 1111 1111 please"
    ids = Tokenizer.from_file(str(resolve_model(None) / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    as_text = refusal(lambda: client.completions.create(model=MODEL, prompt=text, max_tokens=2))
    as_ids = refusal(lambda: client.completions.create(model=MODEL, prompt=ids, max_tokens=2))
    assert as_ids["code"] == as_text["code"] and as_ids["param"] == "prompt", (as_ids, as_text)
    harmless = client.completions.create(model=MODEL, prompt=ids[:3], max_tokens=1)  # ids pass when their text does
    assert harmless.choices[0].finish_reason


def test_langchains_openai_llm_invokes_and_batches(gateway: Service) -> None:
    """LangChain's `OpenAI` LLM (completions, not chat): one prompt, and a batch of ten in one request (its
    batch_size is 20: more prompts than one request's n allows, each with its own choice)."""
    from langchain_openai import OpenAI

    llm = OpenAI(model=MODEL, base_url=gateway.url + "/v1", api_key=KEYS["plus"], max_tokens=4,  # type: ignore[arg-type]
                 temperature=0, max_retries=0, timeout=120)
    one = llm.invoke(PROMPT)
    assert one == sdk(gateway).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    prompts = [f"{i} + {i} =" for i in range(10)]
    out = llm.generate(prompts)
    assert len(out.generations) == 10 and out.generations[0][0].text and all(len(g) == 1 for g in out.generations)
    assert out.generations[3][0].text == llm.invoke(prompts[3])


def test_a_prompt_that_fills_the_context_beside_max_tokens_is_served(gateway: Service) -> None:
    """No chat template: a prompt of token ids that fills the context beside max_tokens is served, one more
    token is the gateway's 400 naming the prompt (the shard's 2048-token context); a text prompt, one token
    short of that (a BOS a tokenizer may add), likewise."""
    client = sdk(gateway)
    done = client.completions.create(model=MODEL, prompt=[5] * (2048 - 2), max_tokens=2, temperature=0)
    assert done.usage is not None and done.usage.prompt_tokens == 2046
    body = refusal(lambda: client.completions.create(model=MODEL, prompt=[5] * 2047, max_tokens=2))
    assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt"), body
    text = " a" * 2045  # 2045 tokens
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    assert done.usage is not None and done.usage.prompt_tokens == 2045
    body = refusal(lambda: client.completions.create(model=MODEL, prompt=text + " a", max_tokens=2))
    assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt"), body


def test_a_token_id_prompt_is_in_the_rate_limits_estimate(gateway: Service) -> None:
    """The TPM estimate counted a token-id prompt as an empty message (~10 tokens): its ids are counted."""
    time.sleep(2)  # the plus tier's 200k TPM refills ~3.3k tokens a second: the bucket is full again
    raw = httpx.post(gateway.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['plus']}"},
                     json={"model": MODEL, "prompt": [5] * 1500, "max_tokens": 2}, timeout=120)
    assert raw.status_code == 200, raw.text
    taken = int(raw.headers["x-ratelimit-limit-tokens"]) - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert taken >= 1500 + 2, raw.headers


def test_a_deterministic_completion_is_answered_from_the_response_cache(fp32_shard: Service,
                                                                         tmp_path: Path) -> None:
    """With --response-cache, a repeated temperature-0 completion is a HIT with the same text (echo applied to the
    cached reply as to a fresh one), counted under api="text_completion"; a chat request of the same words misses.
    Each request is a row of the usage ledger, as the key's GET /v1/usage sums them."""
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    with gateway_before(fp32_shard, tmp_path, args=["--response-cache", "--usage-db", db,
                                                    "--usage-flush-interval-s", "0.2"]) as gw:
        headers = {"Authorization": f"Bearer {KEYS['plus']}"}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        first = httpx.post(gw.url + "/v1/completions", headers=headers, json=body, timeout=120)
        again = httpx.post(gw.url + "/v1/completions", headers=headers, json={**body, "echo": True}, timeout=120)
        assert (first.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
        assert again.json()["choices"][0]["text"] == PROMPT + first.json()["choices"][0]["text"]
        assert again.json()["object"] == "text_completion"
        chat = httpx.post(gw.url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0})
        assert chat.headers["x-cache"] == "MISS"
        assert metric(gw.url, "switchboard_response_cache_lookups_total", api="text_completion", result="hit") == 1
        billed = sum(r.json()["usage"]["completion_tokens"] for r in (first, again, chat))

        def ledger() -> bool:
            page = httpx.get(gw.url + "/v1/usage", params={"bucket_width": "1h"}, headers=headers, timeout=30).json()
            rows = [x for b in page["data"] for x in b["results"]]
            return sum(x["num_model_requests"] for x in rows) == 3 and sum(x["output_tokens"] for x in rows) == billed

        eventually(ledger, timeout_s=30, what="the three requests' ledger rows")


def test_a_completion_is_traced_across_the_gateway_and_the_shard_without_its_prompt(gateway: Service,
                                                                                   fp32_shard: Service) -> None:
    trace_id = uuid.uuid4().hex
    secret = "Zanzibar-7731 is the passphrase and"
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": secret, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEYS['plus']}",
                            "traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}, timeout=120)
    assert r.status_code == 200, r.text

    def spans(url: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = httpx.get(url + "/debug/spans", params={"trace_id": trace_id},
                                                headers=CLUSTER_HEADERS, timeout=30).json()
        return found

    eventually(lambda: any(s["name"] == "shard.generate" for s in spans(fp32_shard.url)), timeout_s=30)
    both = spans(gateway.url) + spans(fp32_shard.url)
    names = {s["name"]: s for s in both}
    assert {"gateway.request", "router.route", "admission.queue", "shard.generate"} <= set(names), sorted(names)
    assert names["gateway.request"]["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert names["shard.generate"]["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert "Zanzibar" not in json.dumps(both)
