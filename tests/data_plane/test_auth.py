from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from data_plane.common.errors import AuthenticationError
from data_plane.gateway.auth import KeyStore, Principal, generate_key, key_digest

KEY_A = "sk-test-aaaaaaaaaaaa"
KEY_B = "sk-test-bbbbbbbbbbbb"


def _store() -> KeyStore:
    return KeyStore.from_env(f"{KEY_A}:acme:plus,{KEY_B}:globex:free")


def test_from_env_and_authenticate():
    store = _store()
    assert len(store) == 2
    p = store.authenticate(f"Bearer {KEY_A}")
    assert p == Principal(key_id=hashlib.sha256(KEY_A.encode()).hexdigest()[:12], tenant="acme", tier="plus")
    assert store.authenticate(f"bearer   {KEY_B} ").tenant == "globex"
    assert KEY_A not in repr(store) and KEY_A not in repr(p)


def test_from_env_tolerates_blanks_and_colons_in_keys():
    store = KeyStore.from_env(" sk-a:t1:free , ,sk:b:c:t2:plus,")
    assert store.authenticate("Bearer sk-a").tier == "free"
    assert store.authenticate("Bearer sk:b:c").tenant == "t2"
    assert len(KeyStore.from_env("")) == 0


@pytest.mark.parametrize("value", ["sk-a:free", "sk-a", ":t:free", "sk-a:bad tenant:free", "sk a:t:free"])
def test_from_env_rejects_malformed_without_echoing_key(value):
    with pytest.raises(ValueError) as err:
        KeyStore.from_env(value)
    assert "sk-a" not in str(err.value) and "sk a" not in str(err.value)


@pytest.mark.parametrize(
    "header",
    [None, "", "   ", f"Basic {KEY_A}", KEY_A, "Bearer", "Bearer ", f"Bearer {KEY_A} extra",
     f"Token {KEY_A}", "Bearer sk-unknown-key-123456", f"Bearer {KEY_A}x", f"Bearer {KEY_A.upper()}"],
)
def test_401_never_echoes_the_key(header):
    with pytest.raises(AuthenticationError) as err:
        _store().authenticate(header)
    exc = err.value
    assert exc.status == 401 and exc.type == "authentication_error"
    text = str(exc.body())
    for secret in (KEY_A, KEY_A.upper(), "sk-unknown-key-123456", "sk-test"):
        assert secret not in text


def test_401_messages_are_distinct_and_clear():
    store = _store()
    with pytest.raises(AuthenticationError, match="missing API key"):
        store.authenticate(None)
    with pytest.raises(AuthenticationError, match="Bearer"):
        store.authenticate(f"Basic {KEY_A}")
    with pytest.raises(AuthenticationError, match="invalid API key"):
        store.authenticate("Bearer sk-nope")


def test_yaml_plaintext_and_sha256(tmp_path: Path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"key": KEY_A, "tenant": "acme", "tier": "plus"},
        {"key_sha256": key_digest(KEY_B).upper(), "tenant": "globex", "tier": "enterprise"},
    ]}))
    store = KeyStore.from_yaml(path)
    assert store.authenticate(f"Bearer {KEY_A}").tier == "plus"
    p = store.authenticate(f"Bearer {KEY_B}")
    assert (p.tenant, p.tier, p.key_id) == ("globex", "enterprise", key_digest(KEY_B)[:12])


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"tenant": "a", "tier": "free"}, "exactly one"),
        ({"key": KEY_A, "key_sha256": key_digest(KEY_A), "tenant": "a", "tier": "free"}, "exactly one"),
        ({"key_sha256": "abc", "tenant": "a", "tier": "free"}, "64 hexadecimal"),
        ({"key": KEY_A, "tier": "free"}, "keys.0.tenant"),
        ({"key": KEY_A, "tenant": "a"}, "keys.0.tier"),
        ({"key": KEY_A, "tenant": "a", "tier": "free", "extra": 1}, "keys.0.extra"),
        ({"key": 12345678, "tenant": "a", "tier": "free"}, "keys.0.key"),
    ],
)
def test_yaml_validation_errors(tmp_path: Path, entry, fragment):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [entry]}))
    with pytest.raises(ValueError) as err:
        KeyStore.from_yaml(path)
    assert fragment in str(err.value)
    assert KEY_A not in str(err.value) and "12345678" not in str(err.value)


def test_empty_file_is_an_empty_store(tmp_path: Path):
    path = tmp_path / "keys.yaml"
    path.write_text("")
    assert len(KeyStore.from_yaml(path)) == 0
    with pytest.raises(ValueError, match="mapping"):
        KeyStore.from_dict(["not", "a", "mapping"])


def test_merged_and_conflicts():
    a = KeyStore.from_env(f"{KEY_A}:acme:plus")
    b = KeyStore.from_env(f"{KEY_B}:globex:free")
    merged = KeyStore.merged(a, b, a)
    assert len(merged) == 2
    assert merged.authenticate(f"Bearer {KEY_B}").tenant == "globex"
    clash = KeyStore.from_env(f"{KEY_A}:acme:enterprise")
    with pytest.raises(ValueError) as err:
        KeyStore.merged(a, clash)
    assert key_digest(KEY_A)[:12] in str(err.value) and KEY_A not in str(err.value)
    with pytest.raises(ValueError):
        KeyStore.from_env(f"{KEY_A}:acme:plus,{KEY_A}:other:plus")


def test_validate_tiers():
    store = _store()
    store.validate_tiers(["free", "plus", "enterprise"])
    with pytest.raises(ValueError) as err:
        store.validate_tiers(["free", "enterprise"])
    assert "'plus'" in str(err.value) and key_digest(KEY_A)[:12] in str(err.value)
    assert KEY_A not in str(err.value)


def test_generate_key():
    k1, k2 = generate_key(), generate_key("sk-x-")
    assert k1.startswith("sk-sb-") and k2.startswith("sk-x-") and k1 != k2
    assert len(k1) >= len("sk-sb-") + 43 and ":" not in k1 and not any(c.isspace() for c in k1)
