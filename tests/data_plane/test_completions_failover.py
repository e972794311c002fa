"""A legacy completions stream (`POST /v1/completions`) whose shard is killed mid-stream (SIGKILL) resumes on
the other shard from the raw prompt and its text so far (no chat template on either shard), one prompt or
several: the real model, temperature 0, float32 (greedy output is batch-invariant), so the client sees the
text an unbroken stream gives. Two real shards behind a gateway, driven by the openai SDK.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_completions_failover.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.cluster import FP32_SHARD, KEYS, static_shards
from tests.support.metrics import metric
from tests.support.procs import Service


def running(shard: Service) -> float:
    try:
        return metric(shard.url, "vllm:num_requests_running")
    except httpx.HTTPError:
        return 0.0


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[list[Service], Service]]:
    # three: a test kills the one serving, and the next resumes on one of the two left
    with static_shards(FP32_SHARD, FP32_SHARD, FP32_SHARD, gateway_args=("--silence-timeout-s", "30"),
                       ready_timeout=240) as (shards, gw):
        yield shards, gw


def kill_serving(shards: list[Service]) -> list[Service]:
    """kill -9 every shard with a request running: the stream's own."""
    serving = [s for s in shards if s.proc is not None and s.proc.poll() is None and running(s) > 0]
    for s in serving:
        s.kill()
    return serving


def test_a_greedy_completion_resumed_after_its_shard_is_killed_equals_an_unbroken_one(
        real: tuple[list[Service], Service]) -> None:
    shards, gw = real
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=180)

    def stream(prompt: str | list[str], kill_after: int | None) -> tuple[dict[int, str], list[Service]]:
        out: dict[int, str] = {}
        killed: list[Service] = []
        chunks = 0
        for chunk in client.completions.create(model="", prompt=prompt, max_tokens=24, temperature=0, stream=True):
            for choice in chunk.choices:
                out[choice.index] = out.get(choice.index, "") + choice.text
                chunks += 1
                if chunks == kill_after:
                    killed.extend(kill_serving(shards))
        return out, killed

    prompt = "The lighthouse keeper climbed the stairs and"
    whole, _ = stream(prompt, None)
    before = metric(gw.url, "switchboard_router_resumes_total")
    resumed, killed = stream(prompt, 8)
    assert killed and metric(gw.url, "switchboard_router_resumes_total") == before + 1
    assert resumed == whole and len(whole[0]) > 40, (whole, resumed)


def test_an_echoed_loglikelihood_stream_resumed_lists_the_prompt_once(real: tuple[list[Service], Service]) -> None:
    """Echo with logprobs, streamed, its shard killed after the prompt's logprobs came: the resumed shard is not
    asked them again (its prompt holds the output so far), and the client's lists are an unbroken stream's."""
    shards, gw = real
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=180)

    def lists(kill_after: int | None) -> tuple[list[str], list[float | None], str, list[Service]]:
        tokens: list[str] = []
        values: list[float | None] = []
        text, killed, chunks = "", [], 0
        for chunk in client.completions.create(model="", prompt="The lighthouse keeper climbed the stairs and",
                                               max_tokens=24, temperature=0, stream=True, echo=True, logprobs=1):
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs:
                    tokens += choice.logprobs.tokens or []
                    values += choice.logprobs.token_logprobs or []
                chunks += 1
                if chunks == kill_after:
                    killed.extend(kill_serving(shards))
        return tokens, values, text, killed

    tokens, values, text, _ = lists(None)
    assert values[0] is None and values.count(None) == 1 and "".join(tokens) == text
    before = metric(gw.url, "switchboard_router_resumes_total")
    again = lists(6)
    assert again[3] and metric(gw.url, "switchboard_router_resumes_total") == before + 1
    assert again[:3] == (tokens, pytest.approx(values, abs=1e-4), text)
