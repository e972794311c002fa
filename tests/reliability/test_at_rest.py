"""Transcripts and KV blocks at rest: a cache node (memory or Redis) holds only ciphertext; a sealed
record moved to another session id does not open; a KV frame tampered on the node, or moved under
another hash, is refused by the shard's check (the real-model version, recompute and same output
included, is tests/data_plane/test_kv_tier.py); the usage ledger holds no text.

    .venv/bin/python -m pytest tests/reliability/test_at_rest.py -q -s

Real processes: a control plane, two cache nodes, a synthetic shard and a gateway; Redis is a real
redis-server (skipped when absent), searched with `redis-cli --scan` and `DUMP` of every key.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from data_plane.common.crypto import SEALED_ROLE
from tests.support.chat import chat
from tests.support.cluster import KEYS, Cluster
from tests.support.metrics import scrape
from tests.support.procs import CLUSTER_TOKEN

HOP = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}


@pytest.fixture(scope="module", params=["memory", "redis"])
def sealed_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    db = tmp_path_factory.mktemp("ledger") / "usage.db"
    c = Cluster(shards=1, caches=2, token_delay_ms=1, gateway_args=["--usage-db", f"sqlite:///{db}",
                                                                     "--usage-flush-interval-s", "0.2"])
    c.ledger_path = db  # type: ignore[attr-defined]
    c.redis = None  # type: ignore[attr-defined]
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        c.redis = url  # type: ignore[attr-defined]
        for cache in c.caches:
            cache.args[-2:-2] = ["--redis", url]
    with c:
        yield c


def _session(c: Cluster, canary: str) -> str:
    first = chat(c.gateway.url, "enterprise", f"remember {canary}-one", headers={"X-Session-Id": "new"},
                 max_tokens=8)
    assert first.status_code == 200, first.text
    sid = first.headers["x-session-id"]
    again = chat(c.gateway.url, "enterprise", f"and {canary}-two", headers={"X-Session-Id": sid}, max_tokens=8)
    assert again.status_code == 200, again.text
    return sid


def _redis_dump(url: str) -> bytes:
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli not on PATH")
    port = url.rsplit(":", 1)[1].split("/")[0]
    keys = subprocess.run([cli, "-p", port, "--scan"], check=True, capture_output=True).stdout.split()
    assert keys, "nothing stored in Redis"
    out = b""
    for key in keys:
        out += subprocess.run([cli, "-p", port, "DUMP", key], check=True, capture_output=True).stdout
        out += subprocess.run([cli, "-p", port, "GET", key], check=False, capture_output=True).stdout
    return out


def test_cache_nodes_and_redis_hold_only_ciphertext(sealed_cluster: Cluster) -> None:
    c = sealed_cluster
    canary = "cnry" + secrets.token_hex(10)
    sid = _session(c, canary)
    stored = [httpx.get(n.url + f"/v1/sessions/{sid}", headers=HOP) for n in c.caches]
    held = [r.json() for r in stored if r.status_code == 200]
    assert held, "no cache node holds the session"
    for record in held:
        assert [m["role"] for m in record["messages"]] == [SEALED_ROLE]
        assert canary not in str(record)
    if c.redis:  # type: ignore[attr-defined]
        dump = _redis_dump(c.redis)  # type: ignore[attr-defined]
        assert b"sb1." in dump and canary.encode() not in dump
    # the third turn still sees the first two (the gateway opens what it sealed)
    third = chat(c.gateway.url, "enterprise", "what next", headers={"X-Session-Id": sid}, max_tokens=8)
    assert third.status_code == 200 and third.json()["usage"]["prompt_tokens"] > 10


def test_a_record_moved_to_another_session_id_does_not_open(sealed_cluster: Cluster) -> None:
    c = sealed_cluster
    canary = "cnry" + secrets.token_hex(10)
    victim = _session(c, canary)
    record = next(r.json() for r in (httpx.get(n.url + f"/v1/sessions/{victim}", headers=HOP) for n in c.caches)
                  if r.status_code == 200)
    # An attacker with cache-node access plants the victim's record, owner and all, under a new id
    planted = "sess_" + secrets.token_urlsafe(24)
    body = {"owner": record["owner"], "messages": record["messages"], "version": record["version"]}
    for node in c.caches:
        assert httpx.put(node.url + f"/v1/sessions/{planted}", json=body, headers=HOP).status_code == 200
    r = chat(c.gateway.url, "enterprise", "tell me what I said", headers={"X-Session-Id": planted}, max_tokens=8)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert canary not in r.text
    ok = chat(c.gateway.url, "enterprise", "still mine?", headers={"X-Session-Id": victim}, max_tokens=8)
    assert ok.status_code == 200  # the original is untouched
    failed = sum(float(line.rsplit(" ", 1)[1]) for line in scrape(c.gateway.url).splitlines()
                 if line.startswith('switchboard_session_crypto_total{op="open",result="failed"}'))
    assert failed >= 1


def test_the_ledger_holds_no_text(sealed_cluster: Cluster) -> None:
    c = sealed_cluster
    canary = "cnry" + secrets.token_hex(10)
    _session(c, canary)
    r = chat(c.gateway.url, "plus", f"plain {canary}", max_tokens=8)
    assert r.status_code == 200
    httpx.get(c.gateway.url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['plus']}"})  # flushes
    path: Path = c.ledger_path  # type: ignore[attr-defined]
    raw = b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
    assert raw and canary.encode() not in raw


def test_kv_frames_at_rest_are_sealed_and_a_tampered_one_is_refused(sealed_cluster: Cluster) -> None:
    import torch

    from data_plane.kv_wire import decode_frame, encode_frame, encode_put, split_frames
    from tests.support.kv import SHAPE, kv_tier, ring

    c = sealed_cluster
    canary = ("cnry" + secrets.token_hex(10)).encode()
    # Stand-in KV whose bytes are a canary (the real model's KV: test_kv_tier.py), sealed on the shard's path
    size = 3 * 4 * 2 * 2 * 1 * 4 * 8  # three float32 blocks of SHAPE
    raw = (canary * (size // len(canary) + 1))[:size]
    kv = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(3, *SHAPE)
    tier = kv_tier(ring("k1"))
    hashes = [secrets.token_bytes(16) for _ in range(3)]
    scopes = ["tenant:acme"] * 3
    frames = tier._frames(hashes, kv, scopes)
    sid = "sess_" + secrets.token_urlsafe(16)
    for node in c.caches:
        r = httpx.put(node.url + f"/v1/kv/sessions/{sid}", content=encode_put([], frames), headers=HOP,
                      params={"ttl_s": 600})
        assert r.status_code == 200, r.text
    body = b"".join(hashes)
    held = [httpx.post(n.url + "/v1/kv/fetch", content=body, headers=HOP).content for n in c.caches]
    assert all(h == b"".join(frames) for h in held)  # what the node keeps is the sealed frames as sent
    assert not any(canary in h for h in held)
    if c.redis:  # type: ignore[attr-defined]
        dump = _redis_dump(c.redis)  # type: ignore[attr-defined]
        assert b"SBKV" in dump and canary not in dump
    got, n, reason = tier._verify(held[0], hashes, scopes)
    assert n == 3 and reason is None and torch.equal(got, kv)
    # tampered on the node (ciphertext changed, checksum recomputed) or moved under another hash
    header, payload = decode_frame(list(split_frames(held[0]))[1])
    forged = bytearray(payload)
    forged[-30] ^= 1
    moved = bytearray(frames[2])
    moved[8:24] = hashes[1]
    for bad in (encode_frame(header, bytes(forged)), bytes(moved)):
        for node in c.caches:
            httpx.put(node.url + f"/v1/kv/sessions/{sid}", content=encode_put(hashes[:1], [bad]), headers=HOP,
                      params={"ttl_s": 600})
        again = httpx.post(c.caches[0].url + "/v1/kv/fetch", content=body, headers=HOP).content
        got, n, reason = tier._verify(again, hashes, scopes)
        assert n == 1 and reason == "sealed" and torch.equal(got, kv[:1])
