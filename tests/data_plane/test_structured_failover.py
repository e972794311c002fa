"""A constrained stream resumed after its shard is killed stays valid (issue 25): three real float32 torch
shards behind a gateway; mid-way through a json_schema stream, then a tool-call stream, the shard serving
it is killed with SIGKILL. The gateway resumes on another shard with the output already sent; that shard
advances the grammar over it and continues, so the openai SDK's streamed `parse` gets an object valid
against the schema, and the streamed tool call keeps its index, its id and name (sent once) and parses.

    .venv/bin/python -m pytest tests/data_plane/test_structured_failover.py -q     # ~3 min (real model)
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.cluster import FP32_SHARD, KEYS, static_shards
from tests.support.metrics import metric, scrape
from tests.support.procs import Service


class Stop(BaseModel):
    city: str = Field(max_length=20)
    nights: int = Field(ge=1, le=14)


class Trip(BaseModel):
    """Plan a trip through three cities."""

    title: str = Field(max_length=40)
    stops: list[Stop] = Field(min_length=3, max_length=3)


ASK = [{"role": "user", "content": "Plan a trip through three cities in Europe, with a title."}]
KILL_AFTER = 6
"""Chunks the client has received when the serving shard is killed (the output is far from complete)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[Service], Service]]:
    # a generous silence bound: only the kill should move a stream (2 loaded cores)
    with static_shards(FP32_SHARD, FP32_SHARD, FP32_SHARD, gateway_args=("--silence-timeout-s", "30"),
                       ready_timeout=240) as (shards, gw):
        yield shards, gw


def _running(shard: Service) -> float:
    try:
        text = scrape(shard.url, timeout=5)
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _kill_serving(shards: list[Service]) -> Service:
    (serving,) = [s for s in shards if s.proc is not None and s.proc.poll() is None and _running(s) > 0]
    serving.kill()
    return serving


def _resumes(gw: Service) -> float:
    return metric(gw.url, "switchboard_router_resumes_total")


def _grammar_resumes(shards: list[Service]) -> float:
    """Resumed constrained streams the living shards advanced their grammar for (their metric)."""
    total = 0.0
    for s in shards:
        if s.proc is not None and s.proc.poll() is None:
            total += sum(float(line.rsplit(" ", 1)[1]) for line in scrape(s.url).splitlines()
                         if line.startswith("switchboard_shard_grammar_resumes_total") and 'outcome="resumed"' in line)
    return total


def _client(gw: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=180)


def test_a_json_schema_stream_resumed_after_its_shard_is_killed_parses(cluster) -> None:
    shards, gw = cluster
    before = _resumes(gw)
    killed: list[Service] = []
    content = ""
    with _client(gw).chat.completions.stream(model="", messages=ASK, response_format=Trip, max_tokens=200,
                                             temperature=0) as stream:
        chunks = 0
        for event in stream:
            if event.type == "content.delta":
                content += event.delta
                chunks += 1
                if chunks == KILL_AFTER:
                    killed.append(_kill_serving(shards))
        final = stream.get_final_completion()
    assert killed and _resumes(gw) == before + 1 and _grammar_resumes(shards) >= 1
    choice = final.choices[0]
    assert choice.finish_reason == "stop", content
    trip = choice.message.parsed
    assert isinstance(trip, Trip) and len(trip.stops) == 3
    assert Trip.model_validate_json(choice.message.content or "") == trip


def test_a_tool_call_stream_resumed_after_its_shard_is_killed_keeps_its_call(cluster) -> None:
    shards, gw = cluster
    before = _resumes(gw)
    killed: list[Service] = []
    deltas = []
    with _client(gw).chat.completions.stream(model="", messages=ASK, tools=[openai.pydantic_function_tool(Trip)],
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                             temperature=0) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                deltas.extend(event.chunk.choices[0].delta.tool_calls or [])
                if len(deltas) == KILL_AFTER:
                    killed.append(_kill_serving(shards))
        final = stream.get_final_completion()
    assert killed and _resumes(gw) == before + 1
    assert {d.index for d in deltas} == {0}
    assert deltas[0].id and deltas[0].function is not None and deltas[0].function.name == "Trip"
    assert all(d.id is None and (d.function is None or d.function.name is None) for d in deltas[1:])  # id and name once, resumed or not
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.id == deltas[0].id and call.function.name == "Trip"
    trip = call.function.parsed_arguments
    assert isinstance(trip, Trip) and len(trip.stops) == 3
    assert Trip.model_validate_json(call.function.arguments) == trip
