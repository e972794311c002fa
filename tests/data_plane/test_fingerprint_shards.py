"""Real torch shards of two formats: each says its own `system_fingerprint` (what decides its numerics,
data_plane/shard/engines/fingerprint.py) on every body and chunk, in /v1/models and its ready line; a
restart of one configuration says the same one; the gateway passes the serving shard's on.

It was the constant "fp_switchboard_1" on every shard, while one seed gave these two formats other text:
the field OpenAI documents for telling when a backend change may affect a seed's determinism said nothing.
The derivation and the gateway's pass-through in detail: test_fingerprint.py."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.support.cluster import FP32_SHARD, KEYS, static_shards
from tests.support.procs import CLUSTER_HEADERS, CLUSTER_TOKEN, Service

TWO_PLANES = ("--dtype", "float32", "--quantization", "int4", "--quantization-kernel", "blockq_x2", "--threads", "1")
"""Another format than FP32_SHARD's (two int8 planes of activations: other numerics)."""
SMALL = ("--max-num-seqs", "4", "--max-model-len", "512")
ASK: Any = [{"role": "user", "content": "Write one sentence about the sea."}]
SEEDED = {"max_tokens": 12, "temperature": 1.0, "seed": 11}


def card(shard: Service) -> dict[str, Any]:
    return httpx.get(shard.url + "/v1/models", headers=CLUSTER_HEADERS, timeout=30).json()["data"][0]


def said(url: str, key: str) -> list[tuple[str, set[str | None]]]:
    """A seeded reply's text and fingerprint, then the same request streamed: its text and every chunk's."""
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    model = sdk.models.list().data[0].id
    done = sdk.chat.completions.create(model=model, messages=ASK, **SEEDED)
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK, stream=True,
                                              stream_options={"include_usage": True}, **SEEDED))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return [(done.choices[0].message.content or "", {done.system_fingerprint}),
            (streamed, {c.system_fingerprint for c in chunks})]


def test_two_formats_say_two_fingerprints_and_a_restart_says_the_same() -> None:
    with static_shards((*FP32_SHARD, *SMALL), (*TWO_PLANES, *SMALL)) as (shards, gw):
        fps = [card(s)["system_fingerprint"] for s in shards]
        assert all(fp.startswith("fp_") and len(fp) == 13 for fp in fps) and fps[0] != fps[1], fps
        texts = {}
        for shard, fp in zip(shards, fps, strict=True):
            (text, body_fp), (streamed, chunk_fps) = said(shard.url, CLUSTER_TOKEN)
            assert body_fp == chunk_fps == {fp} and streamed == text  # one seed, one fingerprint: one text
            texts[fp] = text
            assert f"fingerprint {fp};" in shard.log_tail(100_000)  # the ready line: where operators look
        # through the gateway: the serving shard's, streamed or not, and the text is that shard's
        for text, said_fps in said(gw.url, KEYS["plus"]):
            assert len(said_fps) == 1 and text == texts[next(iter(said_fps))], (text, said_fps, texts)
        # the same configuration restarted: the same fingerprint (nothing of the process, port or time in it)
        first = shards[0]
        first.stop()
        again = Service(["shard", *FP32_SHARD, *SMALL], port=first.port, ready_timeout=180).start()
        try:
            assert card(again)["system_fingerprint"] == fps[0]
            assert said(again.url, CLUSTER_TOKEN) == [(texts[fps[0]], {fps[0]})] * 2
        finally:
            again.stop()
