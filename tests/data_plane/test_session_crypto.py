"""Transcripts sealed at rest (data_plane/common/crypto.py): binding, rotation, key sources.

    .venv/bin/python -m pytest tests/data_plane/test_session_crypto.py -q
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.crypto import (
    SEALED_ROLE,
    Keyring,
    SealError,
    SealMetrics,
    TranscriptSealer,
    new_key_line,
)

MESSAGES = [{"role": "user", "content": "the canary is cnry-42"}, {"role": "assistant", "content": "noted"}]


def _ring(*kids: str) -> Keyring:
    return Keyring.parse([(k, base64.b64encode(os.urandom(32)).decode()) for k in kids], "test")


def test_a_sealed_transcript_holds_no_plaintext_and_opens_for_its_session_only() -> None:
    registry = CollectorRegistry()
    sealer = TranscriptSealer(_ring("k1"), SealMetrics(registry))
    wire = sealer.seal("sess_a", "owner-1", MESSAGES)
    assert len(wire) == 1 and wire[0]["role"] == SEALED_ROLE and wire[0]["content"].startswith("sb1.k1.")
    assert "cnry" not in wire[0]["content"] and "noted" not in wire[0]["content"]
    assert sealer.open("sess_a", "owner-1", wire) == MESSAGES
    with pytest.raises(SealError):
        sealer.open("sess_b", "owner-1", wire)  # copied to another session id
    with pytest.raises(SealError):
        sealer.open("sess_a", "owner-2", wire)  # owner field rewritten
    version, kid, nonce, body = wire[0]["content"].split(".")
    flipped = body[:-2] + ("A" if body[-2] != "A" else "B") + body[-1]
    with pytest.raises(SealError):
        sealer.open("sess_a", "owner-1", [{"role": SEALED_ROLE, "content": f"{version}.{kid}.{nonce}.{flipped}"}])
    assert sealer.seal("sess_a", "owner-1", MESSAGES) != wire  # a fresh nonce every time
    assert registry.get_sample_value("switchboard_session_crypto_total", {"op": "open", "result": "failed"}) == 3


def test_rotation_keeps_old_sessions_and_unknown_keys_are_refused() -> None:
    old = _ring("k1")
    wire = TranscriptSealer(old).seal("s", "o", MESSAGES)
    new_key = base64.b64encode(os.urandom(32)).decode()
    rotated = Keyring.parse([("k2", new_key), ("k1", base64.b64encode(old.keys["k1"]).decode())], "test")
    sealer = TranscriptSealer(rotated)
    assert sealer.open("s", "o", wire) == MESSAGES  # sealed with k1, still opens
    assert sealer.seal("s", "o", MESSAGES)[0]["content"].startswith("sb1.k2.")  # rewritten with k2
    with pytest.raises(SealError, match="does not have"):
        TranscriptSealer(_ring("k3")).open("s", "o", wire)


def test_plaintext_records_from_before_encryption_still_open() -> None:
    registry = CollectorRegistry()
    assert TranscriptSealer(_ring("k1"), SealMetrics(registry)).open("s", "o", MESSAGES) == MESSAGES
    assert registry.get_sample_value("switchboard_session_crypto_total", {"op": "open", "result": "plaintext"}) == 1


def test_key_sources(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# newest first\n" + new_key_line("k2") + "\n" + new_key_line("k1") + "\n")
    ring = Keyring.from_settings(keys_file=str(path), keys_env=None, cluster_token="t")
    assert ring.current == "k2" and set(ring.keys) == {"k1", "k2"}
    env = Keyring.from_settings(keys_file=None, keys_env="a:" + base64.b64encode(b"x" * 32).decode(), cluster_token=None)
    assert env.current == "a" and env.keys["a"] == b"x" * 32
    one, two = Keyring.derived("cluster-secret"), Keyring.derived("cluster-secret")
    assert one == two and one.keys != Keyring.derived("other").keys  # gateways of one cluster agree
    assert "cluster-secret" not in one.current
    assert Keyring.from_settings(keys_file=None, keys_env=None, cluster_token=None).source.startswith("ephemeral")
    with pytest.raises(ValueError):
        Keyring.from_env_value("short:" + base64.b64encode(b"x" * 16).decode())
    path.write_text("only-an-id\n")
    with pytest.raises(ValueError):
        Keyring.from_file(path)
