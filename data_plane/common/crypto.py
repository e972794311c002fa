"""Session transcripts encrypted at rest: the gateway seals a transcript before it reaches a cache
node or Redis, and opens it after reading; the cache tier only ever holds ciphertext.

    keys = Keyring.from_settings(keys_file=".switchboard/session_keys", keys_env=None, cluster_token=tok)
    sealer = TranscriptSealer(keys, SealMetrics(registry))
    wire = sealer.seal("sess_1", owner, messages)    # [{"role": "sealed", "content": "sb1.k1.<nonce>.<ct>"}]
    messages = sealer.open("sess_1", owner, wire)     # SealError if tampered, moved or the key is unknown

AES-256-GCM (the `cryptography` package), a fresh 96-bit nonce per seal. The associated data binds
the session id and the owner (the key's digest), so a record copied to another session id, or
with its owner field changed, fails to open. A sealed transcript travels in the cache node's
existing wire shape: a single message of role ``sealed`` whose content is the envelope
``sb1.<key id>.<nonce b64url>.<ciphertext+tag b64url>``.

Keys and rotation: a keys file (one ``<key id> <base64 of 32 bytes>`` per line, ``#`` comments) or
``SWITCHBOARD_GATEWAY_SESSION_KEYS`` (``kid:base64,kid:base64``). The first key seals; every listed key
opens, so a new key goes first and the old one stays listed until its sessions have been rewritten
(each turn rewrites the whole transcript) or have expired. Without any key, one is derived from the
cluster token (HKDF-SHA256), so the gateways of one cluster agree; without that either, a random
per-process key (sessions then do not survive a gateway restart: logged as a warning).
`switchboard up` writes a keys file (mode 600). Plaintext records written before encryption was
on still open (counted as ``plaintext``) and are sealed on their next save.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

SESSION_KEYS_ENV = "SWITCHBOARD_GATEWAY_SESSION_KEYS"
"""``kid:base64key,...`` (first seals); read by every gateway, like the cluster token."""
SEALED_ROLE = "sealed"
ENVELOPE_VERSION = "sb1"
KEY_BYTES = 32
NONCE_BYTES = 12
AAD_PREFIX = b"switchboard-session-v1\x00"
TRANSCRIPT_KEY_INFO = b"switchboard session transcripts v1"
"""HKDF info of the transcript key derived from the cluster token (KV blocks use their own label:
data_plane/shard/kv_seal.py), so the two keys differ."""


class SealError(Exception):
    """A sealed transcript that cannot be opened: tampered with, moved to another session or
    owner, or sealed with a key this gateway does not have."""


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_key_line(kid: str) -> str:
    """One line of a keys file with a fresh random key."""
    return f"{kid} {base64.b64encode(os.urandom(KEY_BYTES)).decode()}"


@dataclass(frozen=True)
class Keyring:
    """Key id -> 32-byte key; `current` seals."""

    keys: Mapping[str, bytes]
    current: str
    source: str
    """Where the keys came from (file, env, cluster-token, ephemeral), for the start-up log."""

    def __post_init__(self) -> None:
        if self.current not in self.keys:
            raise ValueError("the current key is not in the keyring")
        for kid, key in self.keys.items():
            if len(key) != KEY_BYTES or not kid or "." in kid or len(kid) > 32:
                raise ValueError(f"session key {kid!r}: want a 1-32 character id without '.' and 32 key bytes")

    @classmethod
    def parse(cls, pairs: Sequence[tuple[str, str]], source: str) -> Keyring:
        keys: dict[str, bytes] = {}
        for kid, b64 in pairs:
            try:
                keys[kid.strip()] = base64.b64decode(b64.strip(), validate=True)
            except ValueError:
                raise ValueError(f"session key {kid!r} in {source}: not base64") from None
        if not keys:
            raise ValueError(f"no session keys in {source}")
        return cls(keys, pairs[0][0].strip(), source)

    @classmethod
    def from_file(cls, path: str | Path) -> Keyring:
        lines = [ln.split("#", 1)[0].strip() for ln in Path(path).read_text().splitlines()]
        pairs = [tuple(ln.split(None, 1)) for ln in lines if ln]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{path}: each line is '<key id> <base64 key>'")
        return cls.parse(pairs, f"file {path}")  # type: ignore[arg-type]

    @classmethod
    def from_env_value(cls, value: str) -> Keyring:
        pairs = [tuple(item.split(":", 1)) for item in value.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{SESSION_KEYS_ENV}: want 'kid:base64,kid:base64'")
        return cls.parse(pairs, SESSION_KEYS_ENV)  # type: ignore[arg-type]

    @classmethod
    def derived(cls, cluster_token: str, info: bytes = TRANSCRIPT_KEY_INFO) -> Keyring:
        """One key from the cluster token (HKDF-SHA256); `info` names what it is for."""
        key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(cluster_token.encode())
        kid = "ct" + hashlib.sha256(b"kid" + key).hexdigest()[:8]
        return cls({kid: key}, kid, "derived from the cluster token")

    @classmethod
    def ephemeral(cls) -> Keyring:
        return cls({"eph": os.urandom(KEY_BYTES)}, "eph", "ephemeral (this process only)")

    @classmethod
    def from_settings(cls, *, keys_file: str | None, keys_env: str | None, cluster_token: str | None,
                      info: bytes = TRANSCRIPT_KEY_INFO, env_name: str = SESSION_KEYS_ENV,
                      consequence: str = "sessions will not survive a gateway restart or move between gateways",
                      ) -> Keyring:
        """The first that is given: a keys file, the env value, the cluster token (HKDF with `info`);
        else ephemeral, with a warning saying the `consequence`."""
        if keys_file:
            return cls.from_file(keys_file)
        if keys_env:
            return cls.from_env_value(keys_env)
        if cluster_token:
            return cls.derived(cluster_token, info)
        log.warning("no keys (a keys file or %s) and no cluster token: sealing with a per-process key; %s",
                    env_name, consequence)
        return cls.ephemeral()


class SealMetrics:
    """Sealing and opening of session transcripts (docs/metrics.md)."""

    RESULTS = ("ok", "failed", "unknown_key", "plaintext")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ops = Counter("switchboard_session_crypto_total",
                           "Session transcripts sealed (op=seal) or opened (op=open) by result: ok, failed "
                           "(tampered, or moved to another session or owner), unknown_key, plaintext (a record "
                           "from before encryption).", ["op", "result"], registry=registry)
        self.ops.labels("seal", "ok")
        for result in self.RESULTS:
            self.ops.labels("open", result)


def _aad(session_id: str, owner: str) -> bytes:
    return AAD_PREFIX + session_id.encode() + b"\x00" + owner.encode()


class TranscriptSealer:
    """Seals and opens whole transcripts for the session store (data_plane/cache/client.py)."""

    def __init__(self, keys: Keyring, metrics: SealMetrics | None = None) -> None:
        self.keys = keys
        self.metrics = metrics or SealMetrics(CollectorRegistry())
        self._aead = {kid: AESGCM(key) for kid, key in keys.keys.items()}

    def seal(self, session_id: str, owner: str, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        plain = json.dumps([{"role": m["role"], "content": m["content"]} for m in messages],
                           ensure_ascii=False, separators=(",", ":")).encode()
        nonce = os.urandom(NONCE_BYTES)
        kid = self.keys.current
        sealed = self._aead[kid].encrypt(nonce, plain, _aad(session_id, owner))
        self.metrics.ops.labels("seal", "ok").inc()
        return [{"role": SEALED_ROLE, "content": f"{ENVELOPE_VERSION}.{kid}.{_b64e(nonce)}.{_b64e(sealed)}"}]

    def open(self, session_id: str, owner: str, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        """The transcript's messages; SealError when it cannot be opened here."""
        if not (len(messages) == 1 and messages[0].get("role") == SEALED_ROLE):
            self.metrics.ops.labels("open", "plaintext").inc()
            return [dict(m) for m in messages]
        try:
            version, kid, nonce, body = str(messages[0]["content"]).split(".")
            if version != ENVELOPE_VERSION:
                raise ValueError(f"envelope {version!r}")
        except ValueError as exc:
            self.metrics.ops.labels("open", "failed").inc()
            raise SealError(f"malformed sealed transcript ({exc})") from None
        aead = self._aead.get(kid)
        if aead is None:
            self.metrics.ops.labels("open", "unknown_key").inc()
            raise SealError(f"sealed with key {kid!r}, which this gateway does not have")
        try:
            plain = aead.decrypt(_b64d(nonce), _b64d(body), _aad(session_id, owner))
            out = json.loads(plain)
        except (InvalidTag, ValueError) as exc:
            self.metrics.ops.labels("open", "failed").inc()
            raise SealError("sealed transcript does not open for this session and owner "
                            f"({type(exc).__name__})") from None
        self.metrics.ops.labels("open", "ok").inc()
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in out]
