"""Revoking an API key ends what it has in flight (data_plane/gateway/revocation.py): its streams end with
an OpenAI-shaped ``invalid_api_key`` error event, its non-streaming requests get 401, the shard stops
generating for it, and the usage it already generated is in the ledger; another key of the same tenant
streams on to the end. Real processes: a synthetic shard with slow tokens, a gateway on a keys file,
`switchboard keys revoke` as an operator runs it.

    .venv/bin/python -m pytest tests/data_plane/test_key_revocation.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from data_plane.gateway.auth import KEY_ID_LENGTH, key_digest
from tests.support.metrics import metric
from tests.support.procs import Service, switchboard
from tests.support.waits import eventually_async

REVOKED, KEPT, REVOKED_R = "sk-test-revoked-0001", "sk-test-kept-0002", "sk-test-revoked-resp-0003"
TOKEN_DELAY_MS = 500
"""A synthetic reply is 16 tokens: ~8 s, so every request is mid-reply when the key goes."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service, Path, Path]]:
    tmp = tmp_path_factory.mktemp("revoke")
    keys, db = tmp / "keys.yaml", tmp / "usage.db"
    _write(keys, REVOKED, KEPT, REVOKED_R)
    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", str(TOKEN_DELAY_MS)]) as shard, \
            Service(["cache-node"]) as cache, \
            Service(["gateway", "--shard-urls", shard.url, "--keys-file", str(keys), "--tokenizer", "whitespace",
                     "--model-name", "synthetic", "--cache-urls", cache.url, "--state-dir", str(tmp),
                     "--usage-db", f"sqlite:///{db}", "--usage-flush-interval-s", "0.2"]) as gw:
        yield shard, gw, keys, db


def _write(path: Path, *keys: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("keys:\n" + "".join(f"- {{key: {k}, tenant: acme, tier: free}}\n" for k in keys))
    os.replace(tmp, path)


def _body(stream: bool) -> dict[str, Any]:
    return {"model": "synthetic", "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 64, "stream": stream}


async def _stream(client: httpx.AsyncClient, key: str, started: asyncio.Event) -> tuple[list[dict[str, Any]], float]:
    """Every data event of a chat stream (``[DONE]`` as {}), and when the stream ended (monotonic)."""
    events: list[dict[str, Any]] = []
    async with client.stream("POST", "/v1/chat/completions", json=_body(True),
                             headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append({} if line == "data: [DONE]" else json.loads(line[6:]))
                if any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events):
                    started.set()
    return events, time.monotonic()


def _rows(db: Path) -> list[tuple[str, int, str, int]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT key_id, status, error_code, completion_tokens FROM usage_records").fetchall()


async def test_revoking_a_key_ends_its_streams_and_requests_and_the_shards_work(
        cluster: tuple[Service, Service, Path, Path]) -> None:
    shard, gw, keys, db = cluster
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        revoked_started, kept_started = asyncio.Event(), asyncio.Event()
        revoked_stream = asyncio.create_task(_stream(client, REVOKED, revoked_started))
        kept_stream = asyncio.create_task(_stream(client, KEPT, kept_started))
        whole = asyncio.create_task(client.post("/v1/chat/completions", json=_body(False),
                                                headers={"Authorization": f"Bearer {REVOKED}"}))
        await asyncio.wait_for(asyncio.gather(revoked_started.wait(), kept_started.wait()), 30)
        await asyncio.sleep(2 * TOKEN_DELAY_MS / 1000)  # the non-streaming one is generating too
        assert metric(shard.url, "vllm:num_requests_running") == 3

        key_id = key_digest(REVOKED)[:KEY_ID_LENGTH]
        gone = await asyncio.to_thread(switchboard, "keys", "revoke", "--keys-file", str(keys), "--digest", key_id)
        assert gone.returncode == 0, gone.stderr
        revoked_at = time.monotonic()

        events, ended_at = await asyncio.wait_for(revoked_stream, 30)
        assert ended_at - revoked_at < 4, f"the revoked key's stream ran {ended_at - revoked_at:.1f} s on"
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == "invalid_api_key", events[-3:]
        assert errors[0]["type"] == "authentication_error" and "revoked" in errors[0]["message"]
        assert events[-1] == {}  # [DONE] after the error event
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)

        r = await asyncio.wait_for(whole, 30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert time.monotonic() - revoked_at < 4
        # the shard stopped generating for the revoked key; the kept key's stream is still running
        await eventually_async(lambda: metric(shard.url, "vllm:num_requests_running") == 1, timeout_s=3,
                               what="the shard running only the kept key's request", detail=shard.log_tail)
        assert not kept_stream.done()

        kept, _ = await asyncio.wait_for(kept_stream, 30)
        assert not [e for e in kept if "error" in e], kept[-3:]
        assert [e["choices"][0]["finish_reason"] for e in kept if e.get("choices")][-1] in ("stop", "length")
        assert (await client.post("/v1/chat/completions", json=_body(False),
                                  headers={"Authorization": f"Bearer {REVOKED}"})).status_code == 401

    assert metric(gw.url, "switchboard_gateway_requests_revoked_total", stage="replying") == 2
    # the usage generated before the revocation is recorded: nothing is lost, nothing free
    await eventually_async(lambda: len([row for row in _rows(db) if row[0] == key_id]) == 2, timeout_s=10,
                           what="the revoked key's two usage records", detail=gw.log_tail)
    revoked_rows = sorted((status, code, tokens) for k, status, code, tokens in _rows(db) if k == key_id)
    assert [(status, code) for status, code, _ in revoked_rows] == [(200, "invalid_api_key"), (401, "invalid_api_key")]
    assert all(tokens > 0 for _, _, tokens in revoked_rows), revoked_rows
    assert "tell me" not in gw.log_tail(100_000)  # the log line names the key id, never the prompt
    assert f"its API key {key_id} was revoked" in gw.log_tail(100_000)


async def _response_events(client: httpx.AsyncClient, key: str, started: asyncio.Event) -> list[dict[str, Any]]:
    """Every event of a streamed Responses API request."""
    events: list[dict[str, Any]] = []
    async with client.stream("POST", "/v1/responses", json={"model": "synthetic", "input": "tell me a long story",
                                                             "stream": True},
                             headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta":
                    started.set()
    return events


async def test_revoking_a_key_ends_its_responses_streams_and_background_responses(
        cluster: tuple[Service, Service, Path, Path]) -> None:
    shard, gw, keys, _ = cluster
    auth = {"Authorization": f"Bearer {REVOKED_R}"}
    before = metric(gw.url, "switchboard_background_responses_total", outcome="failed")
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        started = asyncio.Event()
        streamed = asyncio.create_task(_response_events(client, REVOKED_R, started))
        queued = await client.post("/v1/responses", json={"model": "synthetic", "input": "tell me a long story",
                                                          "background": True}, headers=auth)
        assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text
        rid = queued.json()["id"]
        await asyncio.wait_for(started.wait(), 30)
        await eventually_async(lambda: metric(shard.url, "vllm:num_requests_running") == 2, timeout_s=10,
                               what="the stream and the background response generating", detail=gw.log_tail)

        _write(keys, KEPT)  # REVOKED_R revoked (REVOKED too, by the test before)
        revoked_at = time.monotonic()
        events = await asyncio.wait_for(streamed, 30)
        assert time.monotonic() - revoked_at < 4
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert events[-2]["code"] == "invalid_api_key" and "revoked" in events[-2]["message"]
        assert "revoked" in events[-1]["response"]["error"]["message"]
        await eventually_async(lambda: metric(shard.url, "vllm:num_requests_running") == 0, timeout_s=4,
                               what="the shard's work for the revoked key aborted", detail=shard.log_tail)
        failed = "switchboard_background_responses_total"
        await eventually_async(lambda: metric(gw.url, failed, outcome="failed") == before + 1, timeout_s=5,
                               what="the background response ended failed", detail=gw.log_tail)

        # the key put back, its owner reads what the background response came to: failed, revoked, usage kept
        _write(keys, KEPT, REVOKED_R)
        async def readable() -> bool:
            return (await client.get(f"/v1/responses/{rid}", headers=auth)).status_code == 200

        await eventually_async(readable, timeout_s=10, what="the key back in force", detail=gw.log_tail)
        stored = (await client.get(f"/v1/responses/{rid}", headers=auth)).json()
        assert stored["status"] == "failed" and "revoked" in stored["error"]["message"], stored
        assert stored["usage"]["output_tokens"] > 0, stored


async def test_a_revoked_keys_request_waiting_for_a_slot_gets_401_at_once(
        cluster: tuple[Service, Service, Path, Path], tmp_path: Path) -> None:
    """Before its reply began (here: queued for admission behind another key's stream)."""
    shard = cluster[0]
    keys, waiting = tmp_path / "keys.yaml", "sk-test-queued-0004"
    _write(keys, KEPT, waiting)
    with Service(["gateway", "--shard-urls", shard.url, "--keys-file", str(keys), "--tokenizer", "whitespace",
                  "--model-name", "synthetic", "--cache-urls", "http://127.0.0.1:1", "--usage-db", "off",
                  "--max-inflight", "1", "--queue-timeout-s", "60"]) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            started = asyncio.Event()
            kept = asyncio.create_task(_stream(client, KEPT, started))
            await asyncio.wait_for(started.wait(), 30)
            queued = asyncio.create_task(client.post("/v1/chat/completions", json=_body(False),
                                                     headers={"Authorization": f"Bearer {waiting}"}))
            await eventually_async(lambda: metric(gw.url, "switchboard_admission_queue_depth") == 1, timeout_s=10,
                                   what="the request queued", detail=gw.log_tail)
            _write(keys, KEPT)
            revoked_at = time.monotonic()
            r = await asyncio.wait_for(queued, 30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert "revoked" in r.json()["error"]["message"] and time.monotonic() - revoked_at < 4
            assert not kept.done()
            events, _ = await asyncio.wait_for(kept, 30)
            assert not [e for e in events if "error" in e]
        assert metric(gw.url, "switchboard_gateway_requests_revoked_total", stage="opening") == 1
        assert metric(gw.url, "switchboard_admission_queue_depth") == 0
