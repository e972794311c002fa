"""`system_fingerprint` names what decides a shard's numerics (data_plane/shard/engines/fingerprint.py), and
the gateway passes the serving shard's value through: chunks it builds itself, `n` > 1, a stream resumed
on a shard with another one, the response cache's replays.

It was the constant "fp_switchboard_1" on every body and chunk, while the same `seed` gave other text on a
bf16/int4 shard, a float32 shard and a blockq_x2 shard. The real shards' side (two formats, a restart, the
stored completion): test_fingerprint_shards.py; here the derivation, the events and a real gateway in front
of scripted shards."""

from __future__ import annotations

import asyncio
import json
import os
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry

from data_plane.gateway.response_cache import REPLY_ROLE, CachedReply, ReplayStream, _reply
from data_plane.gateway.safety.filters import RuleSet
from data_plane.gateway.safety.stream import OutputStreamFilter
from data_plane.gateway.stream import Completion
from data_plane.membership.view import Member, StaticMembership
from data_plane.routing.events import Delta, Event, Fingerprint, Finish, parse_line
from data_plane.routing.router import Router, RouterMetrics
from data_plane.routing.upstream import Upstream, UpstreamConfig
from data_plane.shard.engines.fingerprint import NUMERICS_VERSION, Numerics, model_digest
from data_plane.shard.engines.synthetic import SyntheticEngine
from data_plane.shard.engines.vllm_engine import vllm_fingerprint
from data_plane.shard.settings import ShardSettings
from tests.data_plane.test_upstream import BODY, FINISH, Pool, Response, drain, token
from tests.support.cluster import KEYS, api_keys_env
from tests.support.http_stub import serve_app
from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.waits import eventually

BF16_INT4 = Numerics(engine="torch", model="SmolLM2-135M-Instruct", digest="0123456789abcdef", dtype="bfloat16",
                     quantization="int4", kernel="blockq_avx2", weights="int4a8[q4_1,q6,q8_0]",
                     runtime="torch 2.5.1 AVX2")


# -- the derivation ------------------------------------------------------------------------------------


def test_each_thing_that_decides_the_numerics_changes_the_fingerprint_and_nothing_else_is_in_it() -> None:
    base = BF16_INT4.fingerprint()
    assert base.startswith("fp_") and len(base) == 13 and int(base[3:], 16) >= 0
    assert Numerics(**vars(BF16_INT4)).fingerprint() == base  # a restart of the same configuration
    others = {field: Numerics(**{**vars(BF16_INT4), field: value}).fingerprint() for field, value in {
        "engine": "vllm", "model": "other", "digest": "fedcba9876543210", "dtype": "float32",
        "quantization": "none", "kernel": "blockq_x2_avx2", "weights": "int4a8x2[q4_1,q8_0]", "packed": True,
        "runtime": "torch 2.5.1 AVX512", "version": NUMERICS_VERSION + 1}.items()}
    assert base not in others.values() and len(set(others.values())) == len(others), others


def test_the_fingerprint_of_one_configuration_is_pinned() -> None:
    """A change to the derivation (or to NUMERICS_VERSION) changes every shard's fingerprint: deliberate,
    so this value moves with it."""
    assert BF16_INT4.fingerprint() == PINNED


PINNED = "fp_c0dfb8a2bf"


def test_a_models_digest_is_its_content_not_its_place_or_time(tmp_path: Path) -> None:
    def model(folder: Path, weights: bytes, config: str = '{"layers": 2}') -> Path:
        folder.mkdir()
        (folder / "config.json").write_text(config)
        (folder / "model.safetensors").write_bytes(weights)
        (folder / "README.md").write_text(str(folder))  # not a weight: no part of it
        return folder

    big = os.urandom(3 << 20)
    a = model(tmp_path / "a", big)
    b = model(tmp_path / "b", big)
    os.utime(b / "model.safetensors", (1, 1))
    assert model_digest(a) == model_digest(b)
    tail = bytearray(big)
    tail[-1] ^= 1  # a fine-tune of the same shape: its last MiB differs
    assert model_digest(model(tmp_path / "c", bytes(tail))) != model_digest(a)
    assert model_digest(model(tmp_path / "d", big, '{"layers": 3}')) != model_digest(a)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(big[:1000])
    renamed = tmp_path / "copy.gguf"
    renamed.write_bytes(big[:1000])
    assert model_digest(gguf) == model_digest(renamed) != model_digest(a, gguf)
    assert model_digest(a, None) == model_digest(a)


def test_the_synthetic_engine_says_one_fingerprint_whatever_its_settings() -> None:
    assert SyntheticEngine(64).system_fingerprint == SyntheticEngine(4096, 0.01).system_fingerprint
    assert SyntheticEngine.system_fingerprint == Numerics(engine="synthetic", model="synthetic").fingerprint()


def test_a_vllm_shard_is_fingerprinted_by_its_version_and_parallel_layout() -> None:
    one = vllm_fingerprint(ShardSettings(engine="vllm"), "/nowhere", "m", "0.6.0")
    assert one == vllm_fingerprint(ShardSettings(engine="vllm"), "/nowhere", "m", "0.6.0")
    assert len({one, vllm_fingerprint(ShardSettings(engine="vllm"), "/nowhere", "m", "0.7.0"),
                vllm_fingerprint(ShardSettings(engine="vllm", tensor_parallel_size=2), "/nowhere", "m", "0.6.0"),
                vllm_fingerprint(ShardSettings(engine="vllm", dtype="float16"), "/nowhere", "m", "0.6.0")}) == 4


async def test_a_shard_whose_chunks_say_none_is_fingerprinted_by_its_registration() -> None:
    """vLLM's chunks carry no fingerprint of ours: the gateway reads the one its sidecar registered."""
    for meta, lines, want in [({"fingerprint": "fp_vllm"}, [token("Hi")], "fp_vllm"),
                              ({"fingerprint": "fp_vllm"}, [chunk("fp_own", ROLE), token("Hi")], "fp_own"),
                              ({}, [token("Hi")], None)]:
        router = Router(StaticMembership([Member("s0", "shard", "http://s0", meta=meta)]),
                        RouterMetrics(CollectorRegistry()), policy="least_loaded")
        stream = await Upstream(router, Pool(Response(200, [lines, [FINISH]])), UpstreamConfig()).open(BODY, None)
        events = await drain(stream)
        said = [e.value for e in events if isinstance(e, Fingerprint)]
        assert said == ([want] if want else []), (meta, events)


# -- the events and the gateway's completion -------------------------------------------------------------


def chunk(fp: str | None, delta: dict[str, Any], index: int = 0, finish: str | None = None) -> bytes:
    body: dict[str, Any] = {"object": "chat.completion.chunk",
                            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
    if fp is not None:
        body["system_fingerprint"] = fp
    return b"data: " + json.dumps(body).encode()


ROLE = {"role": "assistant", "content": ""}


def test_a_choices_opening_chunk_says_its_shards_fingerprint_once() -> None:
    assert parse_line(chunk("fp_a", ROLE, index=1)) == [Fingerprint("fp_a", 1)]
    assert parse_line(chunk("fp_a", {"content": "x"})) == [Delta("x")]  # not on every token
    assert parse_line(chunk(None, ROLE)) == []  # a server that says none: nothing to pass on
    assert parse_line(chunk("fp_a", {"role": "assistant", "content": "Hi"})) == [Fingerprint("fp_a"), Delta("Hi")]


class _Source:
    member = None

    def __init__(self, events: list[list[Event]]) -> None:
        self.events = events

    async def batches(self) -> AsyncIterator[list[Event]]:
        for batch in self.events:
            yield batch

    def close(self) -> None:
        pass


def _completion() -> Completion:
    exchange = types.SimpleNamespace(tool_calls=0, usage=None, first_content_at=0.0)
    return Completion(exchange, "m", lambda: OutputStreamFilter([RuleSet({"t": ["never matches"]})]),  # type: ignore[arg-type]
                      types.SimpleNamespace(record=lambda *a: None), save_turn=None)  # type: ignore[arg-type]


def test_the_gateways_chunks_and_body_carry_the_shards_fingerprint_a_resumes_from_then_on() -> None:
    completion = _completion()
    chunks: list[dict[str, Any]] = []

    async def run() -> None:
        source = _Source([[Fingerprint("fp_first"), Delta("Hel")], [Delta("lo")],
                          [Fingerprint("fp_resumed"), Delta(" there")], [Finish("stop")]])
        async for pieces in completion._batches(source):  # type: ignore[arg-type]
            common = {"completion_id": "c", "model": "m", "created": 0, "include_usage": False,
                      "fingerprint": completion.fingerprint}
            for piece in pieces:
                raw = completion._chunk(common, piece, completion._content_suffix)
                chunks.append(json.loads(raw[len(b"data: "):]))

    asyncio.run(run())
    assert [(c["choices"][0]["delta"].get("content"), c["system_fingerprint"]) for c in chunks] == [
        ("Hel", "fp_first"), ("lo", "fp_first"), (" there", "fp_resumed")]
    assert completion.body()["system_fingerprint"] == "fp_resumed"


def test_a_cached_reply_replays_the_fingerprint_it_was_made_with() -> None:
    async def events(reply: CachedReply) -> list[Event]:
        return [e async for batch in ReplayStream(reply).batches() for e in batch]

    made = CachedReply("four", "stop", 3, 1, "fp_made")
    assert asyncio.run(events(made))[0] == Fingerprint("fp_made")
    assert json.loads(json.dumps(made.__dict__)) == {**made.__dict__}
    old = CachedReply(**json.loads('{"text": "four", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 1}'))
    assert not any(isinstance(e, Fingerprint) for e in asyncio.run(events(old)))  # stored before: none to say
    later = {**made.__dict__, "a_later_field": 1}  # what a later gateway may store: read, not a lookup error
    assert _reply([{"role": REPLY_ROLE, "content": json.dumps(later)}]) == made


# -- a real gateway in front of scripted shards ------------------------------------------------------------


def scripted_shard(fp: str, seen: list[dict[str, Any]]) -> FastAPI:
    """A shard that says `fp` and answers "Hello world": a request that says "break" has its stream cut after
    "Hello" (the gateway resumes it elsewhere), its continuation (`continue_final_message`) ends with " world";
    `n` = 2 answers both choices."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "model": "synthetic"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        seen.append(body)

        def event(delta: dict[str, Any], index: int = 0, finish: str | None = None, done: int = 1) -> bytes:
            return (chunk(fp, delta, index, finish)[:-1]
                    + f', "usage": {{"prompt_tokens": 3, "completion_tokens": {done}}}}}\n\n'.encode())

        async def lines() -> AsyncIterator[bytes]:
            n = int(body.get("n") or 1)
            for i in range(n):
                yield event(ROLE, i, done=0)
            if body.get("continue_final_message"):
                yield event({"content": " world"}) + event({}, finish="stop")
            elif n > 1:
                for i in range(n):
                    yield event({"content": f"choice {i}"}, i) + event({}, i, "stop")
            elif "break" in json.dumps(body["messages"]):
                yield event({"content": "Hello"})
                await asyncio.sleep(0.05)
                raise RuntimeError("the scripted shard breaks its stream")  # the connection is cut
            else:
                yield event({"content": "Hello"}) + event({"content": " world"}, done=2) + event({}, finish="stop")
            yield b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[Service, dict[str, str], list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    with serve_app(scripted_shard("fp_shard_a", seen)) as a, serve_app(scripted_shard("fp_shard_b", seen)) as b:
        gw = Service(["gateway", "--shard-urls", f"{a},{b}", "--cache-urls", "http://127.0.0.1:1",
                      "--tokenizer", "whitespace", "--model-name", "synthetic", "--response-cache"],
                     env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        with gw:
            yield gw, {a: "fp_shard_a", b: "fp_shard_b"}, seen


def sdk(gw: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0)


ASK: Any = [{"role": "user", "content": "say hello, then break"}]


def test_a_stream_resumed_on_a_shard_of_another_format_says_the_new_fingerprint_from_then_on(scripted) -> None:
    gw, _, seen = scripted
    chunks = list(sdk(gw).chat.completions.create(model="synthetic", messages=ASK, max_tokens=8, stream=True))
    text = [(c.choices[0].delta.content, c.system_fingerprint) for c in chunks if c.choices and c.choices[0].delta.content]
    first, resumed = text[0][1], text[-1][1]
    assert "".join(t for t, _ in text) == "Hello world"
    assert {first, resumed} == {"fp_shard_a", "fp_shard_b"}, text  # the resume went to the other shard
    assert text == [("Hello", first), (" world", resumed)]
    assert chunks[-1].system_fingerprint == resumed  # the finish too
    assert seen[-1]["continue_final_message"] is True
    done = sdk(gw).chat.completions.create(model="synthetic", messages=ASK, max_tokens=8)
    assert done.choices[0].message.content == "Hello world"
    assert done.system_fingerprint in ("fp_shard_a", "fp_shard_b")  # the one that finished it
    raw = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['plus']}"},
                     json={"model": "synthetic", "messages": ASK, "max_tokens": 8}, timeout=30).json()
    assert raw["system_fingerprint"].startswith("fp_shard_")


def test_several_choices_carry_their_shards_fingerprint(scripted) -> None:
    gw, _, _ = scripted
    chunks = list(sdk(gw).chat.completions.create(model="synthetic", messages=ASK, max_tokens=8, n=2, stream=True,
                                                  stream_options={"include_usage": True}))
    fps = {c.system_fingerprint for c in chunks}
    assert len(fps) == 1 and fps <= {"fp_shard_a", "fp_shard_b"}, fps
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.content) == [0, 1]
    done = sdk(gw).chat.completions.create(model="synthetic", messages=ASK, max_tokens=8, n=2)
    assert done.system_fingerprint in ("fp_shard_a", "fp_shard_b")


def test_a_response_cache_hit_says_the_fingerprint_of_the_shard_that_made_it(scripted) -> None:
    """A deterministic request's reply is kept in the gateway's response cache and replayed to the next
    identical one: the replay says what made its text (it said the constant, as every reply did)."""
    gw, _, _ = scripted
    ask = [{"role": "user", "content": "say hello, cached"}]
    made = sdk(gw).chat.completions.create(model="synthetic", messages=ask, max_tokens=8, temperature=0)
    hits = metric(gw.url, "switchboard_response_cache_lookups_total", result="hit")
    replies: list[Any] = []

    def hit() -> bool:  # the write is made off the request path: the next identical request may miss
        replies.append(sdk(gw).chat.completions.create(model="synthetic", messages=ask, max_tokens=8, temperature=0))
        return metric(gw.url, "switchboard_response_cache_lookups_total", result="hit") > hits

    eventually(hit, 20)
    replayed = replies[-1]
    assert replayed.choices[0].message.content == made.choices[0].message.content == "Hello world"
    assert replayed.system_fingerprint == made.system_fingerprint and made.system_fingerprint.startswith("fp_shard_")
