"""`POST /v1/completions` with `echo` and `logprobs`: the prompt's logprobs (it was a 400), lm-eval-harness's
loglikelihood request (`echo: true, logprobs: 1, max_tokens: 0`: the prompt alone, its first entry null), streamed
and not, a prefix-cache hit, a prompt as token ids, and the prompt then the output. The numbers equal a
teacher-forced computation from the runner's logits (the same model and format, in process).
Real processes: the session's fp32 shard, a cache node and a gateway; the openai SDK.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_completions_echo_logprobs.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.chat import refusal, sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.formats import INVARIANT
from tests.support.procs import Service

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its friends."


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("echo-logprobs")) as gw:
        yield gw


def _teacher_forced(eng: TorchEngine, text: str) -> tuple[list[int], list[float]]:
    ids = eng.encode_text(text)
    logits = eng._runner.forward([(1, ids, 0)], [len(ids)])
    lp = torch.log_softmax(logits.float(), dim=-1)
    return ids, lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def engine() -> Iterator[TorchEngine]:
    """The shard's model and format, in process: the reference's runner."""
    loop = asyncio.new_event_loop()
    eng = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=2, max_model_len=1024, threads=1))
    loop.run_until_complete(eng.start())
    try:
        yield eng
    finally:
        loop.run_until_complete(eng.aclose())
        loop.close()


@pytest.fixture(scope="module")
def reference(engine: TorchEngine) -> tuple[list[int], list[float]]:
    """TEXT's ids and each token's logprob after the ones before it, from one teacher-forced pass of the runner."""
    return _teacher_forced(engine, TEXT)


def _loglikelihood(client: Any, prompt: Any, **more: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                     temperature=0, **more)


def test_the_prompts_logprobs_equal_the_teacher_forced_ones(gateway: Service,
                                                            reference: tuple[list[int], list[float]]) -> None:
    ids, want = reference
    client = sdk(gateway)
    done = _loglikelihood(client, TEXT)
    (choice,) = done.choices
    assert choice.text == TEXT and choice.finish_reason == "length"  # the prompt alone
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(1 <= len(t) <= 2 and lp.tokens[i + 1] in t for i, t in enumerate(lp.top_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 0
    assert done.usage.total_tokens == len(ids)

    # streamed: the same lists, the prompt's text and its entries on the choice's first chunk
    chunks = list(_loglikelihood(client, TEXT, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == TEXT
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for g in got for t in g.tokens] == lp.tokens
    assert [v for g in got for v in g.token_logprobs] == lp.token_logprobs
    assert [o for g in got for o in g.text_offset] == lp.text_offset

    # again: the shard's prefix cache holds this prompt now (bypassed for prompt logprobs: the same numbers)
    assert _loglikelihood(client, TEXT).choices[0].logprobs.token_logprobs == lp.token_logprobs

    # the prompt as token ids: its text echoed (decoded at the gateway), the same numbers
    as_ids = _loglikelihood(client, ids).choices[0]
    assert as_ids.text == TEXT and as_ids.logprobs.token_logprobs == lp.token_logprobs


def test_echo_with_output_lists_the_prompt_then_the_output(gateway: Service,
                                                          reference: tuple[list[int], list[float]]) -> None:
    ids, want = reference
    client = sdk(gateway)
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0, logprobs=2)
    both = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    (choice,) = both.choices
    assert choice.text == TEXT + plain.choices[0].text
    lp = choice.logprobs
    assert lp.tokens == [*lp.tokens[:len(ids)], *plain.choices[0].logprobs.tokens]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[len(ids):] == [len(TEXT) + o for o in plain.choices[0].logprobs.text_offset]
    assert both.usage.completion_tokens == plain.usage.completion_tokens


def test_every_choice_of_several_prompts_lists_its_own_prompt(gateway: Service,
                                                              reference: tuple[list[int], list[float]]) -> None:
    _, want = reference
    client = sdk(gateway)
    other = "One, two, three, four,"
    for stream in (False, True):
        if stream:
            got: dict[int, list[Any]] = {}
            for chunk in _loglikelihood(client, [TEXT, other], n=2, stream=True):
                for c in chunk.choices:
                    got.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
            values = [got[i] for i in range(4)]
        else:
            values = [c.logprobs.token_logprobs for c in _loglikelihood(client, [TEXT, other], n=2).choices]
        assert values[0] == values[1] and values[2] == values[3] and len(values[2]) != len(values[0])
        assert all(v[0] is None and None not in v[1:] for v in values)
        assert values[0][1:] == pytest.approx(want, abs=1e-4)


def test_a_prompt_of_several_prefill_chunks(gateway: Service, engine: TorchEngine) -> None:
    """~700 tokens: the shard's prefill chunks (256) each give their rows, in blocks of 128 (prompt_logprobs.py)."""
    text = " ".join(f"Item {i} is a {('red', 'blue', 'green')[i % 3]} box on shelf {i % 7}." for i in range(60))
    ids, want = _teacher_forced(engine, text)
    assert len(ids) > 600
    lp = _loglikelihood(sdk(gateway), text).choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def test_max_tokens_0_needs_echo_and_prompt_logprobs_are_the_gateways(gateway: Service) -> None:
    client = sdk(gateway)
    body = refusal(lambda: client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0))
    assert body["param"] == "max_tokens" and body["type"] == "invalid_request_error", body
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['plus']}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
